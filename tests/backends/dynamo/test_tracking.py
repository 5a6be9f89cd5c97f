"""Client-side state the backend keeps because Dynamo 1.6.1 does not report it: request ids, aborts, versions."""

from __future__ import annotations

import uuid

from backends_dynamo.admin import Tracker, dynamo_request_id


def test_request_ids_are_uuids_derived_from_caller_ids() -> None:
    assert dynamo_request_id("rollout-1") == dynamo_request_id("rollout-1") != dynamo_request_id("rollout-2")
    assert dynamo_request_id("rollout-1", 1) not in (dynamo_request_id("rollout-1"), dynamo_request_id("rollout-1", 2))
    mine = str(uuid.uuid4())
    assert dynamo_request_id(mine) == mine and dynamo_request_id(mine, 1) != mine
    assert uuid.UUID(dynamo_request_id(None)).version == 4


def test_a_request_in_flight_during_an_abort_of_everything_is_aborted() -> None:
    track = Tracker()
    before = track.begin("a", None)
    assert track.abort_everything() == ["a"]
    after = track.begin("b", None)  # sent after the pause(abort): not aborted by it
    assert track.end(before) == (True, None) and track.end(after) == (False, None)


def test_aborts_by_id_reach_every_sample_in_flight_and_unknown_ids_too() -> None:
    track = Tracker()
    flights = [track.begin(dynamo_request_id("r", i), "r") for i in range(3)]
    other = track.begin(dynamo_request_id("s"), "s")
    uuids = track.abort_ids(["r", "unknown"])
    assert set(uuids) == {f.uuid for f in flights} | {dynamo_request_id("unknown")}
    assert [track.end(f)[0] for f in flights] == [True] * 3 and track.end(other)[0] is False


def test_a_version_is_attached_only_when_it_held_for_the_whole_request() -> None:
    track = Tracker()
    track.set_weight_version("v1")
    steady = track.begin("a", None)
    assert track.end(steady) == (False, "v1")
    spanning = track.begin("b", None)
    track.set_weight_version("v2")
    assert track.end(spanning) == (False, None)
