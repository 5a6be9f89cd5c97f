"""The SGLang emulator against the real 0.5.23 captures: each captured request is replayed and the answer must
have the captured status and the same JSON structure (keys and value types, recursively); error texts that are
deterministic must match word for word. The tiny models here are not the capture's, so values differ."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import Callable
from typing import Any

import httpx
import numpy as np
import pytest
from safetensors.numpy import load_file

from backends_sglang_testing import SglangEmulator
from backends_testkit.tinymodel import TinyModels

from ._helpers import capture, client_of

#: Keys whose variant legitimately depends on the model's values (a stop where the capture ran to the length
#: limit, a prefix-cache hit where it had none): only checked to be present.
LOOSE = frozenset({"finish_reason", "cached_tokens_details"})


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    return {int: "int", float: "float", str: "str", list: "list", dict: "object"}[type(value)]


def shape_diff(expected: Any, actual: Any, path: str = "$", *, subset: bool = False) -> list[str]:
    """Structural differences: object keys and value kinds, recursively; lists element by element up to the
    shorter length. ``subset``: ``actual`` may lack keys of ``expected`` and a null in ``expected`` matches anything."""
    if subset and expected is None:
        return []
    if _kind(expected) != _kind(actual):
        return [f"{path}: {_kind(expected)} expected, got {_kind(actual)} ({actual!r:.60})"]
    if isinstance(expected, dict):
        missing, extra = set(expected) - set(actual), set(actual) - set(expected)
        diffs = [] if subset else [f"{path}: missing keys {sorted(missing)}"] * bool(missing)
        diffs += [f"{path}: unexpected keys {sorted(extra)}"] * bool(extra)
        for key in sorted(set(expected) & set(actual)):
            if key not in LOOSE:
                diffs += shape_diff(expected[key], actual[key], f"{path}.{key}", subset=subset)
        return diffs
    if isinstance(expected, list):
        return [
            d
            for i, (e, a) in enumerate(zip(expected, actual, strict=False))
            for d in shape_diff(e, a, f"{path}[{i}]", subset=subset)
        ]
    return []


def substitute(value: Any, models: TinyModels) -> Any:
    """The capture's model paths replaced by the local tiny models."""
    if isinstance(value, str):
        return (
            value.replace("/models/tiny-lora", str(models.lora))
            .replace("/models/tiny-qwen3-moe", str(models.moe))
            .replace("/models/tiny-qwen3", str(models.dense))
        )
    if isinstance(value, list):
        return [substitute(v, models) for v in value]
    if isinstance(value, dict):
        return {k: substitute(v, models) for k, v in value.items()}
    return value


async def replay(emulator: SglangEmulator, name: str, models: TinyModels) -> tuple[dict[str, Any], httpx.Response]:
    cap = capture(name)
    req = cap["request"]
    async with client_of(emulator) as http:
        response = await http.request(req["method"], req["path"], json=substitute(req["json"], models))
    return cap, response


def body_of(response: httpx.Response) -> Any:
    return response.json() if response.headers.get("content-type") == "application/json" else response.text


# (capture, engine, what to check exactly besides status and structure)
DENSE = [
    ("generate_ids_logprobs", None),
    ("generate_batch", None),
    ("generate_ignore_eos_special", None),
    ("generate_text", None),
    ("generate_stop_str", None),
    ("generate_stop_token_ids", None),
    ("generate_return_prompt_ids", None),
    ("generate_after_update", None),
    ("score_max0", None),
    ("score_max1", None),
    ("score_start3_nocache", None),
    ("score_start0_cached_full", None),
    ("token_ids_logprob", None),
    ("logprob_temp0", None),
    ("generate_unknown_sp", "body"),
    ("generate_bad_type", "body"),
    ("generate_empty", "body"),
    ("model_info", None),
    ("get_model_info", None),
    ("v1_models", None),
    ("v1_loads", None),
    ("health", "body"),
    ("health_generate", "body"),
    ("ready", "body"),
    ("flush_cache", "body"),
    ("flush_cache_get", "body"),
    ("abort_request", "body"),
    ("abort_all", "body"),
    ("metrics", "body"),
    ("update_weight_version", "body"),
    ("update_weights_from_disk", "body"),
    ("update_weights_from_disk_bad", None),
]


@pytest.mark.parametrize(("name", "exact"), DENSE)
async def test_dense_captures_replay_with_their_status_and_structure(
    make_emulator: Callable[..., SglangEmulator], tiny_models: TinyModels, name: str, exact: str | None
) -> None:
    cap, response = await replay(make_emulator(), name, tiny_models)
    assert response.status_code == cap["status"], response.text
    body = body_of(response)
    assert shape_diff(cap["response"], body) == []
    if exact:
        assert body == cap["response"]
    if cap.get("content_type") is None:
        assert "content-type" not in response.headers


@pytest.mark.parametrize("name", ["server_info", "get_server_info"])
async def test_server_info_is_a_faithful_subset(
    make_emulator: Callable[..., SglangEmulator], tiny_models: TinyModels, name: str
) -> None:
    cap, response = await replay(make_emulator(), name, tiny_models)
    assert response.status_code == 200
    body = response.json()
    assert shape_diff(cap["response"], body, subset=True) == []
    engine_len = 2048  # the reference engine's context length
    assert body["max_req_input_len"] == min(engine_len - 1, body["max_total_num_tokens"] - 1) - 5


async def test_lora_captures_replay_in_their_order(
    make_emulator: Callable[..., SglangEmulator], tiny_models: TinyModels
) -> None:
    emulator = make_emulator()
    for name, exact in [
        ("load_lora_adapter", None),
        ("load_lora_adapter_dup", "error_message"),
        ("lora_generate_adapter", None),
        ("lora_generate_base", None),
        ("lora_generate_unknown", "body"),
        ("lora_v1_models", None),
        ("unload_lora_adapter", "body"),
        ("unload_lora_adapter_again", "body"),
    ]:
        cap, response = await replay(emulator, name, tiny_models)
        assert response.status_code == cap["status"], (name, response.text)
        body = response.json()
        assert shape_diff(cap["response"], body) == [], name
        if exact == "body":
            assert body == cap["response"], name
        elif exact:
            assert body[exact] == cap["response"][exact], name
    assert body["loaded_adapters"] is None


async def test_moe_captures_replay_with_routed_experts(
    make_emulator: Callable[..., SglangEmulator], tiny_models: TinyModels
) -> None:
    emulator = make_emulator(moe=True, enable_return_routed_experts=True)
    cap, response = await replay(emulator, "moe_generate_routed", tiny_models)
    assert response.status_code == 200
    body = response.json()
    assert shape_diff(cap["response"], body) == []
    meta = body["meta_info"]
    routing = np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype="<i4")
    rows = meta["prompt_tokens"] + meta["completion_tokens"] - 1
    assert routing.size == rows * 2 * 2  # [prompt + completion - 1, layers, top_k] as in the capture (7 x 2 x 2)
    cap, response = await replay(emulator, "moe_generate_no_routed", tiny_models)
    assert response.status_code == 200 and "routed_experts" not in response.json()["meta_info"]


async def test_routed_experts_start_len_drops_the_leading_rows(
    make_emulator: Callable[..., SglangEmulator], tiny_models: TinyModels
) -> None:
    emulator = make_emulator(moe=True, enable_return_routed_experts=True)
    base = {"input_ids": [100, 200, 300, 400, 500], "sampling_params": {"max_new_tokens": 3, "temperature": 0}}
    async with client_of(emulator) as http:
        full = (await http.post("/generate", json={**base, "return_routed_experts": True})).json()
        delta = (
            await http.post("/generate", json={**base, "return_routed_experts": True, "routed_experts_start_len": 3})
        ).json()
        scored = (
            await http.post(
                "/generate",
                json={**base, "sampling_params": {"max_new_tokens": 0}, "return_routed_experts": True},
            )
        ).json()

    def rows(answer: dict[str, Any]) -> np.ndarray:
        return np.frombuffer(base64.b64decode(answer["meta_info"]["routed_experts"]), "<i4").reshape(-1, 2, 2)

    assert rows(full).shape == (7, 2, 2) and rows(delta).shape == (4, 2, 2) and rows(scored).shape == (4, 2, 2)
    np.testing.assert_array_equal(rows(delta), rows(full)[3:])  # as the notes saw: start 3 -> 4 rows


async def test_routed_experts_need_the_server_flag(
    make_emulator: Callable[..., SglangEmulator], tiny_models: TinyModels
) -> None:
    _, response = await replay(make_emulator(moe=True), "moe_generate_routed", tiny_models)
    assert response.status_code == 200 and "routed_experts" not in response.json()["meta_info"]


async def test_prompt_logprob_entries_start_at_logprob_start_len_with_a_null(
    make_emulator: Callable[..., SglangEmulator],
) -> None:
    ids = [11, 22, 33, 44, 55, 66]
    async with client_of(make_emulator()) as http:

        async def score(start: int) -> list[Any]:
            body = {
                "input_ids": ids,
                "sampling_params": {"max_new_tokens": 0},
                "return_logprob": True,
                "logprob_start_len": start,
            }
            entries: list[Any] = (await http.post("/generate", json=body)).json()["meta_info"]["input_token_logprobs"]
            return entries

        full, tail = await score(0), await score(3)
    assert [e[1] for e in full] == ids and full[0][0] is None and all(e[0] < 0 for e in full[1:])
    assert [e[1] for e in tail] == ids[3:] and tail[0][0] is None  # the trap: position 3 has a logprob at start 0
    assert tail[1:] == full[4:]


async def test_max_new_tokens_is_silently_clipped_near_the_limit(make_emulator: Callable[..., SglangEmulator]) -> None:
    emulator = make_emulator(max_total_num_tokens=64)  # max_req_len 63, max_req_input_len 58
    body = {"input_ids": [5] * 50, "sampling_params": {"max_new_tokens": 40, "ignore_eos": True}}
    async with client_of(emulator) as http:
        clipped = await http.post("/generate", json=body)
        too_long = await http.post("/generate", json={**body, "input_ids": [5] * 59})
        info = (await http.get("/server_info")).json()
    assert clipped.status_code == 200 and clipped.json()["meta_info"]["completion_tokens"] == 63 - 50 - 1
    assert too_long.status_code == 400 and "exceeds the maximum allowed length (58 tokens)" in too_long.text
    assert info["max_req_input_len"] == 58


async def test_n_samples_answer_a_list_with_suffixed_ids(make_emulator: Callable[..., SglangEmulator]) -> None:
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2, "n": 3, "sampling_seed": 1}, "rid": "r"}
    async with client_of(make_emulator()) as http:
        answer = (await http.post("/generate", json=body)).json()
    assert isinstance(answer, list) and [a["meta_info"]["id"] for a in answer] == ["r_0", "r_1", "r_2"]


async def test_pause_modes_as_captured(make_emulator: Callable[..., SglangEmulator]) -> None:
    """pause_continue.json: abort ends in-flight requests; retract and in_place keep them (they finish after
    continue); in_place refuses /flush_cache; requests sent while paused run after continue."""
    cap = capture("pause_continue")
    long = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}
    short = {"input_ids": [4, 5, 6], "sampling_params": {"max_new_tokens": 4}}
    emulator = make_emulator()
    async with client_of(emulator) as http:
        for mode in ("abort", "retract", "in_place"):
            inflight = asyncio.create_task(http.post("/generate", json=long))
            while not emulator.engine.state().in_flight:  # noqa: ASYNC110 - polling the engine
                await asyncio.sleep(0.005)
            paused = await http.post("/pause_generation", json={"mode": mode})
            assert paused.status_code == 200 and paused.json() == cap[f"pause_{mode}"]["response"]
            late = asyncio.create_task(http.post("/generate", json=short))
            await asyncio.sleep(0.05)
            assert not late.done()
            if mode == "in_place":
                refused = await http.post("/flush_cache")
                assert (refused.status_code, refused.text) == (400, cap["flush_cache_while_paused_in_place"]["body"])
            resumed = await http.post("/continue_generation", json={})
            assert resumed.json() == cap[f"continue_after_{mode}"]["response"]
            first, second = (await inflight).json(), (await late).json()
            expected = cap[f"inflight_during_pause_{mode}"]["finish_reason"]
            assert first["meta_info"]["finish_reason"]["type"] == expected["type"]
            if mode == "abort":
                assert first["meta_info"]["finish_reason"] == expected and len(first["output_ids"]) < 400
            else:
                assert len(first["output_ids"]) == 400
            assert second["meta_info"]["finish_reason"] == {"type": "length", "length": 4}


async def test_abort_request_matches_id_prefixes(make_emulator: Callable[..., SglangEmulator]) -> None:
    cap = capture("abort_by_rid")
    emulator = make_emulator()
    long = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 400, "ignore_eos": True, "n": 2}}
    async with client_of(emulator) as http:
        task = asyncio.create_task(http.post("/generate", json={**long, "rid": "long-1"}))
        while emulator.engine.state().in_flight < 2:  # noqa: ASYNC110 - polling the engine
            await asyncio.sleep(0.005)
        aborted = await http.post("/abort_request", json=cap["abort_request"]["request"])
        answers = (await task).json()
    assert aborted.status_code == 200 and aborted.content == b""
    assert [a["meta_info"]["finish_reason"] for a in answers] == [
        cap["generate_long_1"]["meta_info"]["finish_reason"]
    ] * 2


async def test_weight_update_session_rules_and_distributed_update(
    make_emulator: Callable[..., SglangEmulator], tiny_models: TinyModels
) -> None:
    """update_weights_from_distributed.json / update_weights_from_tensor.json: the begin/end session, a
    norm-weight update that changes the logprobs and a restore that brings them back exactly."""
    dist, tensor = capture("update_weights_from_distributed"), capture("update_weights_from_tensor")
    original = load_file(str(tiny_models.dense / "model.safetensors"))
    scale = {"factor": 3.0}

    def trainer(group: str, announced: Any) -> dict[str, np.ndarray]:
        """The trainer's side of the broadcast: the original tensors times a factor."""
        assert group == "weight_update_group"
        return {name: original[name] * scale["factor"] for name, _dtype, _shape in announced}

    emulator = make_emulator(weight_source=trainer)
    probe = {"input_ids": [100, 200, 300], "sampling_params": {"max_new_tokens": 3, "temperature": 0}}
    probe |= {"return_logprob": True}

    async def logprobs(http: httpx.AsyncClient) -> list[float]:
        answer = (await http.post("/generate", json=probe)).json()
        return [e[0] for e in answer["meta_info"]["output_token_logprobs"]]

    async with client_of(emulator) as http:
        before = await logprobs(http)
        end = await http.post("/end_weight_update", json={})
        assert (end.status_code, end.json()) == (400, tensor["end_without_begin"]["response"])
        update = dist["update_weights_from_distributed_scaled_x3"]["request"]
        outside = await http.post("/update_weights_from_distributed", json=update)
        assert outside.status_code == 400 and "between begin_weight_update()" in outside.json()["message"]
        init = await http.post("/init_weights_update_group", json=dist["init_weights_update_group"]["request"])
        assert init.json() == dist["init_weights_update_group"]["response"]
        assert (await http.post("/begin_weight_update", json={})).json() == dist["begin_scaled_x3"]["response"]
        twice = await http.post("/begin_weight_update", json={})
        assert (twice.status_code, twice.json()) == (400, tensor["begin_twice"]["response"])
        updated = await http.post("/update_weights_from_distributed", json=update)
        assert updated.json() == dist["update_weights_from_distributed_scaled_x3"]["response"]
        assert (await http.post("/end_weight_update", json={})).json() == dist["end_scaled_x3"]["response"]
        after = await logprobs(http)
        info = (await http.get("/model_info")).json()
        scale["factor"] = 1.0  # restore
        await http.post("/begin_weight_update", json={})
        restore = dist["update_weights_from_distributed_restore"]["request"]
        assert (await http.post("/update_weights_from_distributed", json=restore)).json()["success"] is True
        await http.post("/end_weight_update", json={})
        restored = await logprobs(http)
        destroy = dist["destroy_weights_update_group"]["request"]
        assert (await http.post("/destroy_weights_update_group", json=destroy)).json() == dist[
            "destroy_weights_update_group"
        ]["response"]
        again = await http.post("/destroy_weights_update_group", json=destroy)
        assert (again.status_code, again.json()) == (400, dist["destroy_again"]["response"])
    assert info["weight_version"] == "dist-scaled_x3"
    assert not np.allclose(after, before, atol=1e-3)
    np.testing.assert_allclose(restored, before, atol=1e-6)


async def test_a_flush_refused_inside_a_weight_update_crashes_the_server(
    make_emulator: Callable[..., SglangEmulator], tiny_models: TinyModels
) -> None:
    """SGLang asserts its post-update flush succeeded: with requests pending the scheduler dies."""
    emulator = make_emulator()
    long = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}
    async with client_of(emulator) as http:
        task = asyncio.create_task(http.post("/generate", json=long))
        while not emulator.engine.state().in_flight:  # noqa: ASYNC110 - polling the engine
            await asyncio.sleep(0.005)
        await http.post("/pause_generation", json={"mode": "in_place"})
        with pytest.raises(httpx.RemoteProtocolError, match="Cache flush failed"):
            await http.post("/update_weights_from_disk", json={"model_path": str(tiny_models.dense)})
        with pytest.raises(httpx.RemoteProtocolError):
            await task
        with pytest.raises(httpx.ConnectError, match="died"):
            await http.get("/health")


async def test_release_memory_needs_an_idle_server(make_emulator: Callable[..., SglangEmulator]) -> None:
    emulator = make_emulator()
    async with client_of(emulator) as http:
        released = await http.post("/release_memory_occupation", json={})
        assert (released.status_code, released.json()) == (200, None)
        assert (await http.get("/health_generate")).status_code == 503  # asleep: no generation
        assert (await http.post("/resume_memory_occupation", json={})).json() is None
        assert (await http.get("/health_generate")).status_code == 200
        task = asyncio.create_task(
            http.post("/generate", json={"input_ids": [1], "sampling_params": {"max_new_tokens": 300}})
        )
        while not emulator.engine.state().in_flight:  # noqa: ASYNC110 - polling the engine
            await asyncio.sleep(0.005)
        with pytest.raises(httpx.RemoteProtocolError, match="idle"):
            await http.post("/release_memory_occupation", json={})
        with pytest.raises(httpx.RemoteProtocolError):
            await task


async def test_admin_key_guards_the_control_routes_only(make_emulator: Callable[..., SglangEmulator]) -> None:
    emulator = make_emulator(api_key="user-key", admin_api_key="admin-key")
    async with (
        client_of(emulator) as anonymous,
        client_of(emulator, authorization="Bearer user-key") as user,
        client_of(emulator, authorization="Bearer admin-key") as admin,
    ):
        assert (await anonymous.get("/health")).status_code == 200
        assert (await anonymous.get("/model_info")).status_code == 401
        assert (await user.get("/model_info")).status_code == 200
        refused = await user.post("/flush_cache")
        assert (refused.status_code, refused.json()) == (401, {"error": "Unauthorized"})
        assert (await admin.post("/flush_cache")).status_code == 200
        assert (await admin.get("/model_info")).status_code == 401  # normal routes want the normal key


async def test_unsupported_features_are_refused_not_ignored(make_emulator: Callable[..., SglangEmulator]) -> None:
    async with client_of(make_emulator()) as http:
        for extra in (
            {"sampling_params": {"repetition_penalty": 1.2}},
            {"stream": True, "sampling_params": {"n": 2}},
            {"stream": True, "sampling_params": {"stop": ["x"]}},
        ):
            response = await http.post("/generate", json={"input_ids": [1, 2], **extra})
            assert response.status_code == 400 and "emulator" in response.json()["error"]["message"]
        assert (await http.post("/v1/chat/completions", json={})).status_code == 404
        assert (await http.get("/generate")).json() == {"detail": "Method Not Allowed"}


async def test_the_emulator_is_also_an_asgi_app(make_emulator: Callable[..., SglangEmulator]) -> None:
    transport = httpx.ASGITransport(app=make_emulator().asgi())
    async with httpx.AsyncClient(transport=transport, base_url="http://sglang.test") as http:
        answer = await http.post("/generate", json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}})
        flushed = await http.get("/flush_cache")
    assert answer.status_code == 200 and len(answer.json()["output_ids"]) <= 2
    assert flushed.status_code == 200 and flushed.text.startswith("Cache flushed.")


async def test_a_stream_sends_cumulative_events_then_the_whole_answer(
    make_emulator: Callable[..., SglangEmulator],
) -> None:
    """SGLang's default streaming form: each event holds everything so far, the last one is the whole answer."""
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}}
    body |= {"return_logprob": True}
    async with client_of(make_emulator()) as http:
        whole = (await http.post("/generate", json=body)).json()
        streamed = await http.post("/generate", json=body | {"stream": True})
    assert streamed.headers["content-type"].startswith("text/event-stream")
    events = [line[6:] for line in streamed.text.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert [len(c["output_ids"]) for c in chunks] == [1, 2, 3, 4, 4]
    assert all(c["meta_info"]["completion_tokens"] == len(c["output_ids"]) for c in chunks)
    assert [c["meta_info"]["finish_reason"] for c in chunks[:-1]] == [None] * 4
    assert chunks[-1]["output_ids"] == whole["output_ids"]
    assert chunks[-1]["meta_info"]["finish_reason"] == whole["meta_info"]["finish_reason"]
    assert len(chunks[-2]["meta_info"]["output_token_logprobs"]) == 4
