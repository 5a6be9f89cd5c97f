"""``POST /v1/chat/completions`` and ``POST /v1/completions`` of the emulated frontend, over the engine.

Validation order and messages follow the frontend: ``nvext`` deserialization (deny-unknown), unknown top-level
fields, empty messages / prompt, more than 32 stop token ids, ``max_tokens`` 0, ``n > 1`` with completion ids,
the model (404; 503 while the worker sleeps, and "Service temporarily unavailable" for the deployment's
``wake_lag`` after it woke), out-of-vocabulary ids ("Invalid request"). The request id is the
``x-dynamo-request-id`` header when it is a UUID (else a new one): answers are ``chatcmpl-<uuid>`` /
``cmpl-<uuid>`` and the worker's ``abort_request`` takes the bare UUID. Aborted requests finish with ``stop``.
A streamed request of one prompt and one sample streams each token's chunk as the engine produces it (the last
token's chunk, which carries the finish reason and the engine record, once the engine finished); a client that
leaves aborts it. Several prompts or samples stream once all finished.
The reference engine has no penalties: non-neutral ones are refused (400) rather than ignored.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncGenerator, Mapping, Sequence
from typing import Any

import attrs
import httpx
import numpy as np

from backends_dynamo_testing import _shapes
from backends_dynamo_testing._deployment import Deployment
from backends_dynamo_testing._schema import CHAT_FIELDS, COMPLETION_FIELDS, HttpError, check_nvext, check_top_level
from backends_testkit.emulator import json_reply, sse_reply
from backends_testkit.engine import EngineError, EngineOutput, EngineRequest, EngineStep, EngineStream

__all__ = ["Generation"]

_DESERIALIZE = "Failed to deserialize the JSON body into the target type: "
_NEUTRAL = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0}
_MAX_STOP_IDS = 32
_GUIDED = ("guided_json", "guided_regex", "guided_grammar", "guided_choice")


@attrs.frozen(kw_only=True)
class _Ask:
    """A validated generation request."""

    chat: bool
    model: str
    lora: str | None
    prompts: tuple[tuple[int, ...], ...]
    n: int
    max_tokens: int | None
    sampling: Mapping[str, Any]
    logprobs: int | None
    prompt_logprobs: int | None
    as_ids: bool
    stream: bool
    include_usage: bool
    continuous_usage: bool
    extra: frozenset[str]
    uuid: str


def _typed(body: Mapping[str, Any], key: str, kinds: tuple[type, ...], default: Any) -> Any:
    value = body.get(key, default)
    if value is None:
        return default
    if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
        raise HttpError(400, f"{_DESERIALIZE}{key}: invalid type {type(value).__name__}")
    return value


def _annotated(nvext: Mapping[str, Any]) -> frozenset[str]:
    """A ``query_instance_id`` annotation (GAIE) adds the worker id to the answer (round-robin router)."""
    notes = nvext.get("annotations") or ()
    return frozenset({"worker_id"}) if any(str(n).startswith("query_instance_id") for n in notes) else frozenset()


def _request_uuid(request: httpx.Request) -> str:
    try:
        return str(uuid.UUID(request.headers.get("x-dynamo-request-id", "")))
    except ValueError:
        return str(uuid.uuid4())


class Generation:
    """The two generation routes of one :class:`Deployment`."""

    def __init__(self, deployment: Deployment) -> None:
        self.d = deployment

    async def handle(self, request: httpx.Request, *, chat: bool) -> httpx.Response:
        started = time.time()
        raw = request.content.decode("utf-8", "replace")
        try:
            body = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise HttpError(400, f"Failed to parse the request body as JSON: {exc.msg}") from exc
        if not isinstance(body, Mapping):
            raise HttpError(400, f"{_DESERIALIZE}expected a JSON object")
        ask = self._parse(body, raw, chat=chat, rid=_request_uuid(request))
        if ask.stream and ask.n == 1 and len(ask.prompts) == 1:
            (engine_request,) = self._engine_requests(ask)
            try:
                steps = self.d.engine.generate_stream(engine_request)
            except EngineError as exc:
                raise HttpError(400, str(exc)) from exc
            return sse_reply(
                self._live(ask, engine_request, steps, started),
                content_type="text/event-stream",  # the frontend's, without a charset
                dumps=lambda c: json.dumps(c, separators=(",", ":")),
            )
        outputs = await self._run(ask)
        if ask.stream:
            return httpx.Response(
                200, text=self._stream(ask, outputs, started), headers={"content-type": "text/event-stream"}
            )
        return json_reply(200, self._answer(ask, outputs, started))

    # -- request ------------------------------------------------------------------------------------

    def _parse(self, body: Mapping[str, Any], raw: str, *, chat: bool, rid: str) -> _Ask:
        if not isinstance(body.get("model"), str):
            raise HttpError(400, f"{_DESERIALIZE}missing field `model`")
        nvext = body.get("nvext")
        check_nvext(nvext, raw)
        nvext = nvext or {}
        check_top_level(body, CHAT_FIELDS if chat else COMPLETION_FIELDS)
        if chat and not body.get("messages"):
            raise HttpError(400, "Validation: The 'messages' field cannot be empty. At least one message is required.")
        if not chat and body.get("prompt") in (None, "", []):
            raise HttpError(400, "Validation: Prompt string array cannot be empty")
        stop_ids = _typed(body, "stop_token_ids", (list,), [])
        if len(stop_ids) > _MAX_STOP_IDS:
            raise HttpError(400, f"Maximum of {_MAX_STOP_IDS} stop token IDs allowed, got {len(stop_ids)}")
        max_tokens = _typed(body, "max_completion_tokens", (int,), None)
        max_tokens = _typed(body, "max_tokens", (int,), None) if max_tokens is None else max_tokens
        if max_tokens is not None and max_tokens <= 0:
            raise HttpError(400, f"Validation: Max tokens must be greater than 0, got {max_tokens}")
        n = _typed(body, "n", (int,), 1)
        extra = frozenset(nvext.get("extra_fields") or ())
        if n > 1 and "completion_token_ids" in extra:
            raise HttpError(400, "Validation: nvext.extra_fields 'completion_token_ids' is not supported with n > 1")
        for key, neutral in _NEUTRAL.items():
            if _typed(body, key, (int, float), neutral) != neutral:
                raise HttpError(400, f"emulator: {key} is not supported by the reference engine")
        stop = body.get("stop")
        stop = () if stop is None else (stop,) if isinstance(stop, str) else tuple(stop)
        if not all(isinstance(x, str) for x in stop):
            raise HttpError(400, "Failed to deserialize the JSON body into the target type: stop: expected strings")
        for key in _GUIDED:
            if body.get(key) is not None:
                raise HttpError(400, f"emulator: {key} (guided decoding) is not supported by the reference engine")
        instance = nvext.get("backend_instance_id")
        if instance is not None and instance != self.d.worker_id:
            raise HttpError(400, "Invalid request")
        lora = self.d.resolve(body["model"])
        self.d.check_routable()
        if chat:
            logprobs = _typed(body, "top_logprobs", (int,), 0) if _typed(body, "logprobs", (bool,), False) else None
        else:
            logprobs = _typed(body, "logprobs", (int,), None)
        options = body.get("stream_options") or {}
        prompts = self._prompts(body, nvext, chat=chat)
        self._check_context(prompts, max_tokens)
        return _Ask(
            chat=chat,
            model=body["model"],
            lora=lora,
            prompts=prompts,
            n=n,
            max_tokens=max_tokens,
            sampling={
                "temperature": float(_typed(body, "temperature", (int, float), 1.0)),
                "top_p": float(_typed(body, "top_p", (int, float), 1.0)),
                "top_k": _typed(body, "top_k", (int,), -1),
                "min_p": float(_typed(body, "min_p", (int, float), 0.0)),
                "seed": _typed(body, "seed", (int,), None),
                "stop_token_ids": tuple(stop_ids),
                # the 1.6.1 frontend drops stop strings when ignore_eos is set (seen live)
                "stop": () if _typed(body, "ignore_eos", (bool,), False) else tuple(x for x in stop if x),
                "ignore_eos": _typed(body, "ignore_eos", (bool,), False),
                "min_tokens": _typed(body, "min_tokens", (int,), 0),
            },
            logprobs=logprobs,
            prompt_logprobs=_typed(body, "prompt_logprobs", (int,), None),
            as_ids=_typed(body, "return_tokens_as_token_ids", (bool,), False),
            stream=_typed(body, "stream", (bool,), False),
            include_usage=isinstance(options, Mapping) and bool(options.get("include_usage")),
            continuous_usage=isinstance(options, Mapping) and bool(options.get("continuous_usage_stats")),
            extra=extra | _annotated(nvext),
            uuid=rid,
        )

    def _check_context(self, prompts: tuple[tuple[int, ...], ...], max_tokens: int | None) -> None:
        """The frontend's ``context_length`` 400 (as captured on 1.6.1 with the vLLM worker): a prompt that leaves
        no room for one token, or prompt + ``max_tokens`` beyond the model's ``context_window``."""
        limit = self.d.engine.max_model_len
        for prompt in prompts:
            actual = len(prompt) if len(prompt) >= limit else len(prompt) + (max_tokens or 0)
            if actual > limit or len(prompt) >= limit:
                details = {"type": "context_length", "limit": limit, "actual": actual}
                raise HttpError(
                    400, "", body={"message": "Invalid request", "type": "Bad Request", "code": 400, "details": details}
                )

    def _prompts(self, body: Mapping[str, Any], nvext: Mapping[str, Any], *, chat: bool) -> tuple[tuple[int, ...], ...]:
        """``nvext.token_data`` replaces the prompt; else the messages through the chat template, or the
        completions ``prompt`` (text, ids, or a batch of ids)."""
        if nvext.get("token_data") is not None:
            prompts = [list(nvext["token_data"])]
        elif chat:
            try:
                prompts = [self.d.text.render(body["messages"], body.get("tools"), body.get("chat_template_kwargs"))]
            except ValueError as exc:
                raise HttpError(400, f"Validation: {exc}") from exc
        else:
            prompt = body["prompt"]
            if isinstance(prompt, str):
                prompts = [self.d.text.encode(prompt)]
            elif all(isinstance(p, list) for p in prompt):
                prompts = prompt
            else:
                prompts = [prompt]
        vocab = self.d.engine.vocab_size
        for ids in prompts:
            if not ids or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids):
                raise HttpError(400, "Invalid request")
        return tuple(tuple(ids) for ids in prompts)

    # -- engine -------------------------------------------------------------------------------------

    def _engine_requests(self, ask: _Ask) -> list[EngineRequest]:
        routing = self.d.routed_experts and bool(ask.extra & {"engine_data", "routed_experts"})
        seed = ask.sampling["seed"]
        requests = []
        for p, prompt in enumerate(ask.prompts):
            room = self.d.engine.max_model_len - len(prompt)
            for i in range(ask.n):
                index = p * ask.n + i
                requests.append(
                    EngineRequest(
                        prompt_ids=prompt,
                        max_tokens=ask.max_tokens if ask.max_tokens is not None else max(room, 0),
                        **{**ask.sampling, "seed": None if seed is None else seed + index},
                        logprobs=ask.logprobs,
                        prompt_logprobs=None if ask.prompt_logprobs is None else self.d.engine.vocab_size,
                        return_routed_experts=routing,
                        lora=ask.lora,
                        request_id=ask.uuid if index == 0 else f"{ask.uuid}-{index}",
                    )
                )
        return requests

    async def _run(self, ask: _Ask) -> list[EngineOutput]:
        requests = self._engine_requests(ask)
        ids = {r.request_id for r in requests if r.request_id is not None}
        self.d.requests |= ids
        try:
            return list(await asyncio.gather(*(self.d.engine.generate(r) for r in requests)))
        except EngineError as exc:
            raise HttpError(400, str(exc)) from exc
        finally:
            self.d.requests -= ids

    # -- answers ------------------------------------------------------------------------------------

    def _stop_reason(self, ask: _Ask, out: EngineOutput) -> int | str | None:
        """The matched stop token id or stop string; ``None`` for EOS (as vLLM reports it), length and abort."""
        reason = out.stop_reason
        if isinstance(reason, str):
            return reason
        if reason is None or reason not in ask.sampling["stop_token_ids"]:
            return None
        if not ask.sampling["ignore_eos"] and reason in self.d.engine.eos_token_ids:
            return None
        return reason

    @staticmethod
    def _finish(out: EngineOutput) -> str:
        return "stop" if out.finish_reason == "abort" else out.finish_reason  # Dynamo 1.6.1 reports aborts as stop

    def _logprobs(self, ask: _Ask, out: EngineOutput) -> dict[str, Any] | None:
        if ask.logprobs is None or out.logprobs is None:
            return None
        if not ask.chat:
            return _shapes.completion_logprobs_block(self.d.text, out, ask.logprobs, ask.as_ids)
        tops = out.top_logprobs or [[] for _ in out.completion_ids]
        content = [
            _shapes.chat_logprob_entry(self.d.text, t, float(lp), top, ask.logprobs, ask.as_ids)
            for t, lp, top in zip(out.completion_ids, out.logprobs, tops, strict=True)
        ]
        return {"content": content, "refusal": None}

    def _usage(self, ask: _Ask, outputs: Sequence[EngineOutput], done: int | None = None) -> dict[str, Any]:
        """Token counts; ``done`` counts the completion tokens streamed so far (``continuous_usage_stats``)."""
        prompt = sum(len(p) for p in ask.prompts)
        completion = sum(len(o.completion_ids) for o in outputs) if done is None else done
        details: dict[str, Any] = {"cached_tokens": outputs[0].num_cached_tokens}
        if not ask.chat:
            details = {"audio_tokens": None, **details}
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": details,
        }

    def _nvext(
        self, ask: _Ask, out: EngineOutput, started: float, *, final: bool, ids: Sequence[int]
    ) -> dict[str, Any]:
        """``nvext`` of an answer (or of one chunk: ``ids`` are its delta, ``final`` marks the last)."""
        nvext: dict[str, Any] = {}
        if "worker_id" in ask.extra:
            nvext["worker_id"] = {"prefill_worker_id": self.d.worker_id, "decode_worker_id": self.d.worker_id}
        if "completion_token_ids" in ask.extra:
            nvext["completion_token_ids"] = list(ids)
        if not final:
            return nvext
        if "timing" in ask.extra:
            total = (time.time() - started) * 1000
            nvext["timing"] = {
                "request_received_ms": int(started * 1000),
                "prefill_wait_time_ms": 0.0,
                "prefill_time_ms": total / max(len(out.completion_ids), 1),
                "ttft_ms": total / max(len(out.completion_ids), 1),
                "total_time_ms": total,
            }
        single = ask.n == 1 and len(ask.prompts) == 1
        data = _shapes.engine_data(
            out, logprobs=ask.logprobs is not None, prompt_logprobs=ask.prompt_logprobs, single=single
        )
        if "engine_data" in ask.extra:
            nvext["engine_data"] = data
        reason = self._stop_reason(ask, out)
        if "stop_reason" in ask.extra and reason is not None:
            nvext["stop_reason"] = reason
        if "prompt_logprobs" in ask.extra and "prompt_logprobs" in data:
            nvext["prompt_logprobs"] = data["prompt_logprobs"]
        if "routed_experts" in ask.extra and "routed_experts" in data:
            nvext["routed_experts"] = data["routed_experts"]
        return nvext

    def _header(self, ask: _Ask, started: float, *, chunk: bool) -> dict[str, Any]:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if ask.chat else "text_completion"
        head: dict[str, Any] = {"id": f"{'chatcmpl' if ask.chat else 'cmpl'}-{ask.uuid}", "created": int(started)}
        head["model"] = ask.model
        if not ask.chat:
            head["system_fingerprint"] = None
        head["object"] = kind
        return head

    def _answer(self, ask: _Ask, outputs: list[EngineOutput], started: float) -> dict[str, Any]:
        choices = []
        for index, out in enumerate(outputs):
            text = self.d.text.decode(out.completion_ids)
            logprobs = self._logprobs(ask, out)
            if ask.chat:
                message = {"content": text, "refusal": None, "role": "assistant"}
                choice = {"index": index, "message": message, "finish_reason": self._finish(out), "logprobs": logprobs}
            else:
                choice = {"text": text, "index": index}
                if logprobs is not None:
                    choice["logprobs"] = logprobs
                choice["finish_reason"] = self._finish(out)
            choices.append(choice)
        head = self._header(ask, started, chunk=False)
        answer: dict[str, Any] = {"id": head.pop("id"), "choices": choices, **head, "usage": self._usage(ask, outputs)}
        if ask.chat and ask.prompt_logprobs is not None:
            answer["prompt_logprobs"] = _shapes.prompt_logprob_rows(outputs[0], ask.prompt_logprobs)
        nvext = self._nvext(ask, outputs[0], started, final=True, ids=outputs[0].completion_ids)
        if nvext:
            answer["nvext"] = nvext
        return answer

    def _chunks(self, ask: _Ask, index: int, out: EngineOutput, started: float) -> list[dict[str, Any]]:
        """One choice as chunks: one per token; the last carries the finish reason and the engine record."""
        ids = out.completion_ids
        logprobs = self._logprobs(ask, out)
        chunks = []
        for j in range(max(len(ids), 1)):
            final = j >= len(ids) - 1
            piece = self.d.text.decode(ids[: j + 1])[len(self.d.text.decode(ids[:j])) :] if ids else ""
            delta_ids = ids[j : j + 1]
            finish = self._finish(out) if final else None
            if ask.chat:
                delta: dict[str, Any] = {"content": piece} if piece else {}
                if j == 0:
                    delta["role"] = "assistant"
                part = (
                    None
                    if logprobs is None or not ids
                    else {"content": logprobs["content"][j : j + 1], "refusal": None}
                )
                choice: dict[str, Any] = {"index": index, "delta": delta, "finish_reason": finish, "logprobs": part}
            else:
                choice = {"text": piece, "index": index}
                if logprobs is not None and ids:
                    choice["logprobs"] = {key: value[j : j + 1] for key, value in logprobs.items()}
                if finish is not None:
                    choice["finish_reason"] = finish
            chunk = {**self._header(ask, started, chunk=True), "choices": [choice]}
            chunk = {"id": chunk.pop("id"), "choices": chunk.pop("choices"), **chunk}
            if ask.continuous_usage:
                chunk["usage"] = self._usage(ask, [out], done=j + 1)
            elif not ask.chat:
                chunk["usage"] = None
            nvext = self._nvext(ask, out, started, final=final and index == 0, ids=delta_ids)
            if nvext:
                chunk["nvext"] = nvext
            chunks.append(chunk)
        return chunks

    async def _live(
        self, ask: _Ask, request: EngineRequest, steps: EngineStream, started: float
    ) -> AsyncGenerator[dict[str, Any], None]:
        """The chunks of one generation as the engine produces its tokens (the last token's chunk waits for the
        engine's end: it carries the finish reason)."""
        assert request.request_id is not None
        self.d.requests.add(request.request_id)
        ids: list[int] = []
        logprobs: list[float] = []
        rows: list[Any] = []
        sent = 0
        try:
            async for event in steps:
                if isinstance(event, EngineStep):
                    ids += event.completion_ids
                    logprobs += [] if event.logprobs is None else event.logprobs.tolist()
                    rows += event.top_logprobs or []
                    so_far = EngineOutput(
                        request_id=request.request_id,
                        prompt_ids=request.prompt_ids,
                        completion_ids=tuple(ids),
                        finish_reason="length",
                        logprobs=np.asarray(logprobs, dtype=np.float32) if event.logprobs is not None else None,
                        top_logprobs=rows or None,
                    )
                    chunks = self._chunks(ask, 0, so_far, started)[:-1]
                else:
                    chunks = self._chunks(ask, 0, event, started)
                    if ask.include_usage:
                        head = self._header(ask, started, chunk=True)
                        chunks.append({"id": head.pop("id"), "choices": [], **head, "usage": self._usage(ask, [event])})
                for chunk in chunks[sent:]:
                    yield chunk
                sent = len(chunks)
        finally:
            await steps.aclose()
            self.d.requests.discard(request.request_id)

    def _stream(self, ask: _Ask, outputs: list[EngineOutput], started: float) -> str:
        chunks = [c for index, out in enumerate(outputs) for c in self._chunks(ask, index, out, started)]
        if ask.include_usage:
            head = self._header(ask, started, chunk=True)
            chunks.append({"id": head.pop("id"), "choices": [], **head, "usage": self._usage(ask, outputs)})
        return "".join(f"data: {json.dumps(c, separators=(',', ':'))}\n\n" for c in chunks) + "data: [DONE]\n\n"
