"""The reference server: the reference wire dialect served over a :class:`ReferenceEngine`.

Written on :class:`~backends_testkit.emulator.EmulatorBase`: ``emulator.transport()`` answers in-process,
``emulator.asgi()`` under an ASGI server, ``emulator.serve()`` on a real port. Requests are validated strictly,
as a real server would: unknown fields, wrong types and engine refusals are 400s with an ``{"error": ...}`` body;
unknown routes 404; wrong methods 405.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

import httpx
import numpy as np

from backends_core.errors import RenderError
from backends_core.multiturn.rendering import encode, load_tokenizer, render_text
from backends_testkit.emulator import GET, POST, EmulatorBase, Route, sse_reply
from backends_testkit.engine import EngineError, EngineOutput, EngineRequest, EngineStep, ReferenceEngine

__all__ = ["ReferenceEmulator"]

_SAMPLING_FIELDS = {
    "max_tokens": int,
    "temperature": float,
    "top_p": float,
    "top_k": int,
    "min_p": float,
    "seed": (int, type(None)),
    "n": int,
    "stop_token_ids": list,
    "ignore_eos": bool,
    "min_tokens": int,
    "top_logprobs": int,
    "repetition_penalty": float,
    "presence_penalty": float,
    "frequency_penalty": float,
    "stop": list,
    "logit_bias": dict,
}
_GENERATE_FIELDS = {
    "model",
    "input_ids",
    "sampling",
    "request_id",
    "cache_salt",
    "priority",
    "lora",
    "return_routed_experts",
    "routed_experts_start",
    "stream",
}


BodyHandler = Callable[[dict[str, Any]], Awaitable[httpx.Response]]


class BadRequest(Exception):
    """Becomes a 400 with the message as the error body."""


def _json(status: int, body: Any) -> httpx.Response:
    return httpx.Response(status, json=body)


def _body(request: httpx.Request) -> dict[str, Any]:
    try:
        body = json.loads(request.content) if request.content else {}
    except json.JSONDecodeError as exc:
        raise BadRequest(f"body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("body must be a JSON object")
    return body


def _npy_b64(array: np.ndarray) -> str:
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(array))
    return base64.b64encode(buf.getvalue()).decode()


def _check_type(name: str, value: Any, expected: Any) -> None:
    kinds = expected if isinstance(expected, tuple) else (expected,)
    if float in kinds:
        kinds = (*kinds, int)
    if isinstance(value, bool) and bool not in kinds:
        raise BadRequest(f"{name}: expected {expected}, got {value!r}")
    if not isinstance(value, kinds):
        raise BadRequest(f"{name}: expected {getattr(expected, '__name__', expected)}, got {value!r}")


def _token_ids(body: dict[str, Any]) -> list[int]:
    ids = body.get("input_ids")
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise BadRequest("input_ids: expected a list of integers")
    return ids


class ReferenceEmulator(EmulatorBase):
    """Serves the reference dialect for one engine.

    :param engine: the engine to serve.
    :param model_name: the served model name (default: the engine's).
    """

    def __init__(self, engine: ReferenceEngine, *, model_name: str | None = None) -> None:
        super().__init__(engine)
        self.model_name = model_name or engine.model_name

    def routes(self) -> dict[str, Route]:
        def route(handler: BodyHandler, methods: frozenset[str] = POST) -> Route:
            async def answer(request: httpx.Request) -> httpx.Response:
                return await handler(_body(request))

            return Route(answer, methods=methods, level="open")

        return {
            "/generate": route(self._generate),
            "/score": route(self._score),
            "/tokenize": route(self._tokenize),
            "/health": route(self._health, GET),
            "/ready": route(self._ready, GET),
            "/state": route(self._state, GET),
            "/pause": route(self._pause),
            "/resume": route(self._resume),
            "/flush_cache": route(self._flush),
            "/update_weights": route(self._update_weights),
            "/lora/load": route(self._load_lora),
            "/lora/unload": route(self._unload_lora),
            "/sleep": route(self._sleep),
            "/wake": route(self._wake),
            "/abort": route(self._abort),
        }

    def not_found(self, request: httpx.Request) -> httpx.Response:
        return _json(404, {"error": f"no route {request.url.path}"})

    def method_not_allowed(self, request: httpx.Request) -> httpx.Response:
        return _json(405, {"error": f"method {request.method} not allowed on {request.url.path}"})

    def error_response(self, exc: Exception) -> httpx.Response | None:
        if isinstance(exc, (BadRequest, EngineError)):
            return _json(400, {"error": str(exc)})
        return None

    # -- data plane ------------------------------------------------------------------------------

    def _check_model(self, body: dict[str, Any]) -> httpx.Response | None:
        model = body.get("model")
        if model is not None and model != self.model_name:
            return _json(404, {"error": f"model {model!r} does not exist; serving {self.model_name!r}"})
        return None

    async def _generate(self, body: dict[str, Any]) -> httpx.Response:
        unknown = set(body) - _GENERATE_FIELDS
        if unknown:
            raise BadRequest(f"unknown field(s) {sorted(unknown)}")
        if (missing := self._check_model(body)) is not None:
            return missing
        ids = _token_ids(body)
        sampling = body.get("sampling") or {}
        if not isinstance(sampling, dict):
            raise BadRequest("sampling: expected an object")
        for key, value in sampling.items():
            if key not in _SAMPLING_FIELDS:
                raise BadRequest(f"sampling: unknown field {key!r}")
            _check_type(f"sampling.{key}", value, _SAMPLING_FIELDS[key])
        n = sampling.get("n", 1)
        if n < 1:
            raise BadRequest("sampling.n must be >= 1")
        stop = sampling.get("stop", [])
        if not all(isinstance(x, str) and x for x in stop):
            raise BadRequest("sampling.stop: expected non-empty strings")
        bias = sampling.get("logit_bias", {})
        try:
            logit_bias = {int(k): float(v) for k, v in bias.items()}
        except (TypeError, ValueError):
            raise BadRequest("sampling.logit_bias: expected {token id: number}") from None
        seed = sampling.get("seed")
        top = sampling.get("top_logprobs", 0)
        rid = body.get("request_id")
        start = body.get("routed_experts_start", 0)
        want_routing = bool(body.get("return_routed_experts", False))
        if want_routing and not self.engine.is_moe:
            raise BadRequest("return_routed_experts needs a MoE model")
        requests = [
            EngineRequest(
                prompt_ids=ids,
                max_tokens=sampling.get("max_tokens", 16),
                temperature=sampling.get("temperature", 1.0),
                top_p=sampling.get("top_p", 1.0),
                top_k=sampling.get("top_k", -1),
                min_p=sampling.get("min_p", 0.0),
                seed=None if seed is None else seed + i,
                stop_token_ids=sampling.get("stop_token_ids", []),
                stop=stop,
                logit_bias=logit_bias,
                ignore_eos=sampling.get("ignore_eos", False),
                min_tokens=sampling.get("min_tokens", 0),
                logprobs=top,
                return_routed_experts=want_routing,
                routed_experts_start=start,
                lora=body.get("lora"),
                request_id=None if rid is None else (rid if n == 1 else f"{rid}-{i}"),
            )
            for i in range(n)
        ]
        stream = body.get("stream", False)
        _check_type("stream", stream, bool)
        if stream:
            if n != 1:
                raise BadRequest("stream needs sampling.n = 1")
            return sse_reply(self._stream(requests[0], rid, len(ids), top, start), done=False)
        outputs = await asyncio.gather(*(self.engine.generate(r) for r in requests))
        first = outputs[0]
        return _json(
            200,
            {
                "request_id": rid if rid is not None else first.request_id,
                "weight_version": first.weight_version,
                "prompt_tokens": len(ids),
                "cached_tokens": first.num_cached_tokens,
                "samples": [self._sample(out, top, start) for out in outputs],
            },
        )

    def _stream(
        self, request: EngineRequest, rid: str | None, prompt_tokens: int, top: int, start: int
    ) -> AsyncGenerator[dict[str, Any], None]:
        steps = self.engine.generate_stream(request)  # queued now: a refusal is a 400 before streaming

        async def events() -> AsyncGenerator[dict[str, Any], None]:
            try:
                async for step in steps:
                    if isinstance(step, EngineStep):
                        assert step.logprobs is not None
                        yield {"output_ids": list(step.completion_ids), "output_logprobs": step.logprobs.tolist()}
                        continue
                    finish = self._sample(step, top, start)
                    del finish["output_ids"], finish["output_logprobs"]
                    yield {
                        "finish": {
                            "request_id": rid if rid is not None else step.request_id,
                            "weight_version": step.weight_version,
                            "prompt_tokens": prompt_tokens,
                            "cached_tokens": step.num_cached_tokens,
                            **finish,
                        }
                    }
            except EngineError as exc:
                yield {"error": str(exc)}
            finally:
                await steps.aclose()

        return events()

    @staticmethod
    def _sample(out: EngineOutput, top: int, start: int) -> dict[str, Any]:
        assert out.logprobs is not None
        return {
            "output_ids": list(out.completion_ids),
            "output_logprobs": [float(x) for x in out.logprobs],
            "top_logprobs": [[[t, lp] for t, lp in row] for row in out.top_logprobs]
            if top and out.top_logprobs
            else None,
            "finish_reason": out.finish_reason,
            "stop_reason": out.stop_reason,
            "routed_experts": _npy_b64(out.routed_experts) if out.routed_experts is not None else None,
            "routed_experts_start": start,
            "weight_versions": [{"version": s.version, "start": s.start, "end": s.end} for s in out.weight_versions],
        }

    async def _score(self, body: dict[str, Any]) -> httpx.Response:
        unknown = set(body) - {"model", "input_ids", "top_logprobs", "lora"}
        if unknown:
            raise BadRequest(f"unknown field(s) {sorted(unknown)}")
        if (missing := self._check_model(body)) is not None:
            return missing
        ids = _token_ids(body)
        top = body.get("top_logprobs", 0)
        _check_type("top_logprobs", top, int)
        out = await self.engine.score(ids, top_k=top, lora=body.get("lora"))
        assert out.prompt_logprobs is not None
        logprobs: list[float | None] = [None, *(float(x) for x in out.prompt_logprobs[1:])]
        tops = None
        if top and out.prompt_top_logprobs is not None:
            tops = [None, *([[t, lp] for t, lp in row] for row in out.prompt_top_logprobs[1:])]
        return _json(200, {"logprobs": logprobs, "top_logprobs": tops, "weight_version": out.weight_version})

    async def _tokenize(self, body: dict[str, Any]) -> httpx.Response:
        unknown = set(body) - {"model", "messages", "tools", "chat_template_kwargs", "add_generation_prompt"}
        if unknown:
            raise BadRequest(f"unknown field(s) {sorted(unknown)}")
        if not isinstance(body.get("messages"), list):
            raise BadRequest("messages: expected a list")
        tokenizer = load_tokenizer(str(self.engine.model_dir))
        try:
            text = render_text(
                tokenizer,
                body["messages"],
                tools=body.get("tools"),
                add_generation_prompt=bool(body.get("add_generation_prompt", True)),
                chat_template_kwargs=body.get("chat_template_kwargs") or {},
            )
        except RenderError as exc:
            raise BadRequest(str(exc)) from exc
        return _json(200, {"tokens": encode(tokenizer, text)})

    # -- admin plane -----------------------------------------------------------------------------

    async def _health(self, body: dict[str, Any]) -> httpx.Response:
        return _json(200, {"status": "ok"})

    async def _ready(self, body: dict[str, Any]) -> httpx.Response:
        state = self.engine.state()
        return _json(200, {"ready": not state.paused and not state.sleeping})

    async def _state(self, body: dict[str, Any]) -> httpx.Response:
        s = self.engine.state()
        return _json(
            200,
            {
                "paused": s.paused,
                "sleeping": s.sleeping,
                "weight_version": s.weight_version,
                "in_flight": s.in_flight + s.queued,
                "loras": list(s.loras),
            },
        )

    async def _pause(self, body: dict[str, Any]) -> httpx.Response:
        mode = body.get("mode", "abort")
        await self.engine.pause(mode)
        return _json(200, {"paused": True, "mode": mode})

    async def _resume(self, body: dict[str, Any]) -> httpx.Response:
        await self.engine.resume()
        return _json(200, {"paused": False})

    async def _flush(self, body: dict[str, Any]) -> httpx.Response:
        if not self.engine.flush_cache():
            return _json(409, {"error": "cannot flush the prefix cache while requests are in flight"})
        return _json(200, {"flushed": True})

    async def _update_weights(self, body: dict[str, Any]) -> httpx.Response:
        path, version = body.get("path"), body.get("version")
        _check_type("path", path, str)
        _check_type("version", version, (str, type(None)))
        self.engine.load_weights(str(path), weight_version=version)
        return _json(200, {"weight_version": self.engine.weight_version})

    async def _load_lora(self, body: dict[str, Any]) -> httpx.Response:
        _check_type("name", body.get("name"), str)
        _check_type("path", body.get("path"), str)
        self.engine.load_lora(body["name"], body["path"], replace=bool(body.get("replace", False)))
        return _json(200, {"loaded": body["name"]})

    async def _unload_lora(self, body: dict[str, Any]) -> httpx.Response:
        _check_type("name", body.get("name"), str)
        self.engine.unload_lora(body["name"])
        return _json(200, {"unloaded": body["name"]})

    async def _sleep(self, body: dict[str, Any]) -> httpx.Response:
        level = body.get("level", 1)
        _check_type("level", level, int)
        await self.engine.sleep(level)
        return _json(200, {"sleeping": True})

    async def _wake(self, body: dict[str, Any]) -> httpx.Response:
        await self.engine.wake()
        return _json(200, {"sleeping": False})

    async def _abort(self, body: dict[str, Any]) -> httpx.Response:
        ids = body.get("request_ids")
        if ids is None:
            return _json(200, {"aborted": self.engine.abort()})
        if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
            raise BadRequest("request_ids: expected a list of strings or null")
        return _json(200, {"aborted": sum(self.engine.abort(i) for i in ids)})


def make_emulator(engine: ReferenceEngine, *, routed_experts: bool = False) -> ReferenceEmulator:
    """The test kit's emulator factory for the reference backend (it always answers routed experts on MoE)."""
    return ReferenceEmulator(engine)
