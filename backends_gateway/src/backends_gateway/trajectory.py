"""Trajectories: a session's turns as the trainer reads them. Each branch is one exact token sequence (its last
turn's prompt and completion ids) with a loss mask that is 1 exactly on the ids an engine sampled and the
logprobs of those ids at their positions (0 elsewhere). A sequence holding images carries them (encoded files, or
the URL of a remote one) with the span of the ids each was widened into: the placeholder runs a vision-language
trainer fills with the image's features.

:class:`Trajectories` reads them straight from a store (a file, or a PostgreSQL database), as numpy arrays, while
gateways may be writing it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt

from backends_core.images import Image, ImageSpan
from backends_gateway.sessions import Branch, SessionRecord, TurnRecord
from backends_gateway.store import SQLiteStore, SyncReads
from backends_gateway.stores import open_store

__all__ = ["Sample", "Trajectories", "Trajectory", "TrajectoryError", "build", "trajectory_json"]


class TrajectoryError(Exception):
    """A stored branch whose turns do not extend each other's exact ids (a store written by something else)."""


@attrs.frozen(kw_only=True, eq=False)
class Sample:
    """One branch for training.

    :ivar input_ids: int32, the branch's whole sequence (its last turn's prompt and completion).
    :ivar loss_mask: uint8 over ``input_ids``: 1 on ids an engine sampled, 0 on everything rendered.
    :ivar logprobs: float32 over ``input_ids``: the sampling logprob of each sampled id, 0 elsewhere.
    :ivar turns: the turns whose completions it holds, in order.
    :ivar weight_versions: per turn of ``turns``, the weight version that finished it.
    :ivar images: the sequence's images in order (``Image.data``: the encoded file; a remote image has only its
        ``url``, which the engine fetched).
    :ivar image_spans: where each image lies in ``input_ids``: the run of placeholder ids the engine widened it
        into (never sampled, so 0 in ``loss_mask``).
    """

    branch: int
    parent_branch: int | None
    parent_turn: int | None
    reason: str
    input_ids: npt.NDArray[np.int32]
    loss_mask: npt.NDArray[np.uint8]
    logprobs: npt.NDArray[np.float32]
    turns: tuple[int, ...]
    weight_versions: tuple[str | None, ...]
    finish_reason: str
    images: tuple[Image, ...] = ()
    image_spans: tuple[ImageSpan, ...] = ()


@attrs.frozen(kw_only=True, eq=False)
class Trajectory:
    """One session: its summary and a :class:`Sample` per branch."""

    session: str
    group: str | None
    status: str
    reward: float | None
    reward_info: Any
    counts: dict[str, int]
    samples: tuple[Sample, ...]


def build(branches: Sequence[Branch], turns: Sequence[TurnRecord]) -> list[Sample]:
    """A :class:`Sample` per branch that has delivered turns, up to its last delivered turn.

    :raises TrajectoryError: a turn's prompt does not start with its parent turn's exact ids, or its images are
        not the first images of the sequence at the same spans, or it holds images without their spans.
    """
    by_turn = {t.turn: t for t in turns}
    tips: dict[int, TurnRecord] = {}
    for t in turns:
        if t.delivered:  # an answer no harness received is no sample (nor the end of one)
            tips[t.branch] = t
    samples = []
    for branch in branches:
        tip = tips.get(branch.branch)
        if tip is None:
            continue
        lineage = [tip]
        while lineage[-1].parent is not None:
            parent = by_turn.get(lineage[-1].parent)
            if parent is None:
                raise TrajectoryError(f"session {tip.session}: turn {lineage[-1].turn}'s parent is missing")
            lineage.append(parent)
        lineage.reverse()
        ids = np.concatenate([tip.prompt_ids, tip.completion_ids]).astype(np.int32)
        mask = np.zeros(len(ids), dtype=np.uint8)
        logprobs = np.zeros(len(ids), dtype=np.float32)
        for turn in lineage:
            start, end = len(turn.prompt_ids), turn.length
            if not (
                np.array_equal(ids[:start], turn.prompt_ids) and np.array_equal(ids[start:end], turn.completion_ids)
            ):
                raise TrajectoryError(
                    f"session {tip.session}, branch {branch.branch}: turn {turn.turn}'s ids are not a prefix of "
                    f"turn {tip.turn}'s"
                )
            mask[start:end] = 1
            logprobs[start:end] = turn.logprobs
        images = tip.images()
        if len(images) != len(tip.image_spans):
            raise TrajectoryError(
                f"session {tip.session}, branch {branch.branch}: turn {tip.turn} holds {len(images)} images but "
                f"{len(tip.image_spans)} image spans"
            )
        for turn in lineage[:-1]:
            known = len(turn.image_spans)
            if turn.image_spans != tip.image_spans[:known] or turn.images() != images[:known]:
                raise TrajectoryError(
                    f"session {tip.session}, branch {branch.branch}: turn {turn.turn}'s images are not the first "
                    f"images of turn {tip.turn} at the same spans"
                )
        samples.append(
            Sample(
                branch=branch.branch,
                parent_branch=branch.parent_branch,
                parent_turn=branch.parent_turn,
                reason=branch.reason,
                input_ids=ids,
                loss_mask=mask,
                logprobs=logprobs,
                turns=tuple(t.turn for t in lineage),
                weight_versions=tuple(t.weight_version for t in lineage),
                finish_reason=tip.finish_reason,
                images=images,
                image_spans=tip.image_spans,
            )
        )
    return samples


def trajectory_json(session: SessionRecord, branches: Sequence[Branch], turns: Sequence[TurnRecord]) -> dict[str, Any]:
    """The trajectory route's answer: the session, every turn, every branch with its training view."""
    samples = {s.branch: s for s in build(branches, turns)}
    out_branches = []
    for branch in branches:
        entry = branch.as_json()
        entry.pop("session")
        sample = samples.get(branch.branch)
        entry["turns"] = [] if sample is None else list(sample.turns)
        if sample is not None:
            entry["input_ids"] = sample.input_ids.tolist()
            entry["loss_mask"] = sample.loss_mask.tolist()
            entry["logprobs"] = sample.logprobs.tolist()
            entry["image_spans"] = [attrs.asdict(s) for s in sample.image_spans]
            entry["images"] = [image.data_url() for image in sample.images]
        out_branches.append(entry)
    summary = session.as_json()
    # the summary's fields at the top as well, but "turns" there is the list of turns: the count is the summary's
    return {**summary, "summary": summary, "turns": [t.as_json() for t in turns], "branches": out_branches}


class Trajectories:
    """A trainer's reader of a gateway's store::

        for trajectory in Trajectories("rollouts.db").closed(group="step-7"):
            for sample in trajectory.samples:
                train(sample.input_ids, sample.loss_mask, sample.logprobs, trajectory.reward)
                # a vision-language model also takes sample.images, widened at sample.image_spans

    :param store: what the gateway was given as ``--store`` (a file, a ``postgresql://`` URL), or a store.
    """

    def __init__(self, store: str | os.PathLike[str] | SyncReads) -> None:
        if isinstance(store, str | os.PathLike):
            opened = open_store(store)
            if isinstance(opened, SQLiteStore) and not opened.path.exists():
                raise FileNotFoundError(f"no gateway store at {opened.path}")
            if not isinstance(opened, SyncReads):
                raise TypeError(f"{type(opened).__name__} has no blocking reads for the trainer's reader")
            store = opened
        self.store: SyncReads = store

    def get(self, session: str) -> Trajectory:
        """One session, whatever its status.

        :raises KeyError: no such session.
        """
        record = self.store.get_session_sync(session)
        if record is None:
            raise KeyError(f"no session {session!r} in {self.store.where}")
        return self._trajectory(record)

    def _trajectory(self, record: SessionRecord) -> Trajectory:
        samples = build(self.store.branches_sync(record.id), self.store.turns_sync(record.id))
        return Trajectory(
            session=record.id,
            group=record.group,
            status=record.status,
            reward=record.reward,
            reward_info=record.reward_info,
            counts=dict(record.counts),
            samples=tuple(samples),
        )

    def closed(self, *, group: str | None = None, after: float | None = None) -> Iterator[Trajectory]:
        """Closed sessions in the order they closed (after the closing time ``after``, to resume a poll)."""
        return self.sessions(group=group, status="closed", after=after)

    def sessions(
        self, *, group: str | None = None, status: str | None = None, after: float | None = None, page: int = 256
    ) -> Iterator[Trajectory]:
        """Sessions with that group and status, a page of records read at a time."""
        after_id = None
        while True:
            records = self.store.list_sessions_sync(
                group=group, status=status, limit=page, after=after, after_id=after_id
            )
            for record in records:
                yield self._trajectory(record)
            if len(records) < page:
                return
            last = records[-1]
            after, after_id = (last.closed if status == "closed" else last.created), last.id

    def __iter__(self) -> Iterator[Trajectory]:
        return self.closed()
