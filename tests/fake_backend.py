"""A deliberately small third-party-style backend ("fake"), used to prove the plugin path and the whole
pipeline: its own wire dialect, its own emulator over the reference engine, and only three optional hooks.

Dialect::

    POST /v1/tokens {"prompt": [ids], "params": {...}}  -> {"choices": [{"tokens": [[id, logprob], ...],
                                                             "stop": "eos" | "max" | "cut",
                                                             "top": [[[id, logprob], ...], ...] | null}]}
    POST /v1/score  {"tokens": [ids], "top": k}          -> {"scores": [null, logprob, ...],
                                                             "top": [null, [[id, logprob], ...], ...] | null}
    GET  /ping                                            -> 200
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import numpy as np

from backends_core import GenerateResult, ResponseParseError, TeacherLogprobs, TopLogprob, hookimpl
from backends_testkit.emulator import GET, EmulatorBase, Route
from backends_testkit.engine import EngineRequest, EngineRequestError

_FINISH = {"eos": "stop", "max": "length", "cut": "abort"}


@hookimpl
async def post_generate(server, request, config):
    s = request.sampling
    params = {
        "max": s.max_tokens,
        "temp": s.temperature,
        "top_p": s.top_p,
        "top_k": s.top_k,
        "seed": s.seed,
        "n": s.n,
        "stop": list(s.stop_token_ids),
        "ignore_eos": s.ignore_eos,
        "top": s.top_logprobs,
        "min_p": s.min_p,
        "min_tokens": s.min_tokens,
    }
    return await server.request("POST", "/v1/tokens", json_body={"prompt": list(request.prompt_ids), "params": params})


def _top(rows: Any) -> tuple[tuple[TopLogprob, ...], ...] | None:
    if rows is None:
        return None
    return tuple(tuple(TopLogprob(token_id=t, logprob=lp) for t, lp in row or ()) for row in rows)


@hookimpl
def parse_response(raw, request, server_url):
    try:
        choices = raw["choices"]
        results = []
        for c in choices:
            pairs = c["tokens"]
            results.append(
                GenerateResult(
                    prompt_ids=request.prompt_ids,
                    completion_ids=tuple(int(t) for t, _ in pairs),
                    logprobs=np.array([lp for _, lp in pairs], dtype=np.float32),
                    finish_reason=_FINISH[c["stop"]],
                    top_logprobs=_top(c.get("top")),
                    server=server_url,
                )
            )
        return results
    except (KeyError, TypeError, ValueError) as exc:
        raise ResponseParseError(f"fake: bad body: {type(exc).__name__}: {exc}", url=server_url) from exc


@hookimpl
async def teacher_logprobs(server, request):
    raw = await server.request(
        "POST", "/v1/score", json_body={"tokens": list(request.token_ids), "top": request.top_logprobs}
    )
    try:
        scores = raw["scores"]
        if len(scores) != len(request.token_ids) or scores[0] is not None:
            raise ValueError(f"{len(scores)} scores for {len(request.token_ids)} tokens")
        lp = np.array([np.nan, *scores[1:]], dtype=np.float32)
        return TeacherLogprobs(token_ids=request.token_ids, logprobs=lp, top_logprobs=_top(raw.get("top")))
    except (KeyError, TypeError, ValueError) as exc:
        raise ResponseParseError(f"fake: bad score body: {exc}", url=server.base_url) from exc


@hookimpl
async def admin_health(server):
    await server.request("GET", "/ping", plane="admin", expect="none")
    return True


class FakeEmulator(EmulatorBase):
    """The fake dialect over a reference engine."""

    def routes(self) -> dict[str, Route]:
        return {
            "/ping": Route(self._ping, methods=GET, level="open"),
            "/v1/tokens": Route(self._json(self._tokens)),
            "/v1/score": Route(self._json(self._score)),
        }

    def error_response(self, exc: Exception) -> httpx.Response | None:
        return httpx.Response(400, json={"error": str(exc)}) if isinstance(exc, EngineRequestError) else None

    @staticmethod
    def _json(handler: Any) -> Any:
        async def answer(request: httpx.Request) -> httpx.Response:
            return await handler(json.loads(request.content))

        return answer

    async def _ping(self, request: httpx.Request) -> httpx.Response:
        return httpx.Response(200)

    async def _score(self, body: dict[str, Any]) -> httpx.Response:
        out = await self.engine.score(body["tokens"], top_k=body["top"])
        top = [None, *([[t, lp] for t, lp in row] for row in out.prompt_top_logprobs[1:])] if body["top"] else None
        return httpx.Response(200, json={"scores": [None, *map(float, out.prompt_logprobs[1:])], "top": top})

    async def _tokens(self, body: dict[str, Any]) -> httpx.Response:
        p = body["params"]
        choices = []
        for i in range(p["n"]):
            out = await self.engine.generate(
                EngineRequest(
                    prompt_ids=body["prompt"],
                    max_tokens=p["max"],
                    temperature=p["temp"],
                    top_p=p["top_p"],
                    top_k=p["top_k"],
                    min_p=p["min_p"],
                    seed=None if p["seed"] is None else p["seed"] + i,
                    stop_token_ids=p["stop"],
                    ignore_eos=p["ignore_eos"],
                    min_tokens=p["min_tokens"],
                    logprobs=p["top"],
                )
            )
            stop = {"stop": "eos", "length": "max", "abort": "cut"}[out.finish_reason]
            top = [[[t, lp] for t, lp in row] for row in out.top_logprobs] if p["top"] else None
            choices.append(
                {
                    "tokens": [[t, float(lp)] for t, lp in zip(out.completion_ids, out.logprobs, strict=True)],
                    "stop": stop,
                    "top": top,
                }
            )
        return httpx.Response(200, json={"choices": choices})
