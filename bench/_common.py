"""Shared pieces of the benchmarks: fixtures (tiny tokenizer, a 1,024-token chat, canned vLLM bodies), the
instant server's process, CPU pinning and the statistics every script prints.

Nothing here is measured; the scripts import it. Bodies follow vLLM 0.32's ``/inference/v1/generate`` field order
in compact JSON (what starlette sends), with ``"token": "token_id:<id>"`` in every logprob entry because the peer
client ``renderers`` 0.1.12 refuses entries without it (see shared/PERF_BASELINE.md, "Compatibility finding").
"""

from __future__ import annotations

import base64
import io
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
MODEL = "tiny-qwen3"
PROMPT_TOKENS = 1024
COMPLETION_TOKENS = 256
LAYERS, TOP_K, NUM_EXPERTS = 48, 8, 128

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


# -- machine ----------------------------------------------------------------------------------------------


def two_cores() -> bool:
    return hasattr(os, "sched_setaffinity") and len(os.sched_getaffinity(0)) >= 2


def pin(core: int) -> None:
    """Pin this process to one core when the machine has two (client on 0, server on 1)."""
    if two_cores():
        os.sched_setaffinity(0, {core})


def cpu_pressure() -> str | None:
    """The ``some`` line of ``/proc/pressure/cpu`` (share of time some task waited for a CPU), if readable."""
    try:
        return Path("/proc/pressure/cpu").read_text().splitlines()[0]
    except OSError:
        return None


def proc_status_kb(field: str, pid: int | str = "self") -> int:
    """A ``/proc/<pid>/status`` size in KB (``VmRSS``, ``VmHWM``...); -1 if absent."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return -1


def machine() -> dict[str, Any]:
    cpu = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": sys.version.split()[0],
        "cpu_pressure_at_start": cpu_pressure(),
    }


# -- statistics -------------------------------------------------------------------------------------------


def summary(values: Sequence[float], fmt: str = "{:.0f}") -> str:
    """``median [min-max]``."""
    if not values:
        return "-"
    return f"{fmt.format(statistics.median(values))} [{fmt.format(min(values))}-{fmt.format(max(values))}]"


def ratio_summary(values: Sequence[float]) -> str:
    return summary(values, "{:.2f}")


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def save(name: str, data: Any) -> Path:
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(data, indent=1, default=str) + "\n")
    return path


def timeit_us(fn: Callable[[], Any], *, min_time: float = 0.2, min_calls: int = 3) -> float:
    """Median-free mean µs per call of ``fn`` over at least ``min_time`` seconds (one round)."""
    fn()
    calls, started = 0, time.perf_counter()
    while True:
        fn()
        calls += 1
        elapsed = time.perf_counter() - started
        if calls >= min_calls and elapsed >= min_time:
            return elapsed / calls * 1e6


def shuffled(items: Sequence[Any], seed: int) -> list[Any]:
    out = list(items)
    random.Random(seed).shuffle(out)
    return out


# -- fixtures ---------------------------------------------------------------------------------------------


def tokenizer_dir() -> Path:
    from backends_testkit.tinymodel import build_tiny_models, default_models_dir

    return build_tiny_models(default_models_dir()).dense


def tokenizer() -> Any:
    from backends_core.multiturn.rendering import load_tokenizer

    return load_tokenizer(str(tokenizer_dir()))


_WORDS = [
    "the",
    "model",
    "reads",
    "every",
    "token",
    "of",
    "the",
    "prompt",
    "and",
    "routes",
    "each",
    "one",
    "through",
    "eight",
    "experts",
    "of",
    "forty",
    "eight",
    "layers",
    "before",
    "it",
    "samples",
    "an",
    "answer",
    "that",
    "the",
    "trainer",
    "scores",
    "with",
    "a",
    "reward",
    "and",
    "turns",
    "into",
    "a",
    "gradient",
    "step",
]


def _text(n_words: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(_WORDS) for _ in range(n_words))


def chat_messages(tok: Any, prompt_tokens: int = PROMPT_TOKENS) -> list[dict[str, str]]:
    """A 3-turn chat (system + user/assistant/user/assistant/user) rendering to exactly ``prompt_tokens`` ids."""

    def build(extra: str) -> list[dict[str, str]]:
        return [
            {"role": "system", "content": "You are a careful assistant. " + _text(30, 1)},
            {"role": "user", "content": _text(80, 2)},
            {"role": "assistant", "content": _text(100, 3)},
            {"role": "user", "content": _text(80, 4)},
            {"role": "assistant", "content": _text(100, 5)},
            {"role": "user", "content": extra},
        ]

    def count(msgs: list[dict[str, str]]) -> int:
        return len(render_ids(tok, msgs))

    words = 0
    while count(build(_text(words + 10, 6))) <= prompt_tokens:
        words += 10
    while count(build(_text(words + 1, 6))) <= prompt_tokens:
        words += 1
    base = _text(words, 6)
    for suffix in ("", *(" " + "x" * i for i in range(1, 40)), *("." * i for i in range(1, 40))):
        msgs = build(base + suffix)
        if count(msgs) == prompt_tokens:
            return msgs
    raise RuntimeError(f"could not build a chat of exactly {prompt_tokens} tokens")


def chat_variants(tok: Any, n: int = 64, prompt_tokens: int = PROMPT_TOKENS) -> list[list[dict[str, str]]]:
    """``n`` chats that share :func:`chat_messages`'s first five messages and differ in the last user message,
    each rendering to exactly ``prompt_tokens`` ids (a rollout batch: one prefix, distinct last turns)."""
    base = chat_messages(tok, prompt_tokens)
    words = len(base[-1]["content"].split())
    suffixes = ("", *(" " + "x" * i for i in range(1, 40)), *("." * i for i in range(1, 40)))
    out: list[list[dict[str, str]]] = []
    seed = 1000
    while len(out) < n:
        seed += 1
        for w in range(words + 2, words - 8, -1):
            text = _text(w, seed)
            if len(render_ids(tok, [*base[:-1], {"role": "user", "content": text}])) > prompt_tokens:
                continue
            found = None
            for suffix in suffixes:
                msgs = [*base[:-1], {"role": "user", "content": text + suffix}]
                if len(render_ids(tok, msgs)) == prompt_tokens:
                    found = msgs
                    break
            if found is not None:
                out.append(found)
                break
    assert len({m[-1]["content"] for m in out}) == n
    return out


def render_ids(tok: Any, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True) -> list[int]:
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    return list(tok.encode(text, add_special_tokens=False))


def completion_ids(tok: Any, n: int = COMPLETION_TOKENS) -> list[int]:
    """``<think>…</think>`` + answer + ``<|im_end|>``: ``n`` ids."""
    think = tok.convert_tokens_to_ids("<think>")
    end_think = tok.convert_tokens_to_ids("</think>")
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    reasoning = tok.encode("\n" + _text(400, 7) + "\n", add_special_tokens=False)[: n // 2]
    answer = tok.encode("\n\n" + _text(400, 8), add_special_tokens=False)
    ids = [think, *reasoning, end_think]
    ids += answer[: n - len(ids) - 1]
    ids.append(im_end)
    assert len(ids) == n, len(ids)
    return ids


def stop_token_ids(tok: Any) -> list[int]:
    return [tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")]


def experts_array(rows: int, *, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, NUM_EXPERTS, size=(rows, LAYERS, TOP_K), dtype=np.uint8)


def npy_b64(array: np.ndarray) -> str:
    """What vLLM 0.32 sends in ``routed_experts``: base64 of a ``.npy`` file."""
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def generate_body(
    completion: Sequence[int],
    *,
    prompt_tokens: int = PROMPT_TOKENS,
    routed: str | None = None,
    rows: int | None = None,
    seed: int = 0,
) -> bytes:
    """A ``/inference/v1/generate`` answer. ``routed``: ``None`` (``null``), ``"npy"`` (vLLM 0.32: a base64 ``.npy``
    string, what our vLLM backend parses) or ``"object"`` (``{"data", "shape", "start", "dtype"}``, the form
    renderers' splice parser recognises)."""
    rng = random.Random(seed)
    content = []
    for t in completion:
        lp = -rng.random() * 3
        content.append({"token": f"token_id:{t}", "token_id": t, "logprob": lp, "rank": 1, "top_logprobs": []})
    n_rows = rows if rows is not None else prompt_tokens + len(completion) - 1
    routed_value: Any = None
    if routed == "npy":
        routed_value = npy_b64(experts_array(n_rows, seed=seed))
    elif routed == "object":
        raw = experts_array(n_rows, seed=seed).tobytes()
        routed_value = {
            "data": base64.b64encode(raw).decode("ascii"),
            "shape": [n_rows, LAYERS, TOP_K],
            "start": 0,
            "dtype": "uint8",
        }
    body = {
        "request_id": "generate-tokens-bench",
        "model": MODEL,
        "created": 1795304516,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "total_tokens": prompt_tokens + len(completion),
            "completion_tokens": len(completion),
            "prompt_tokens_details": None,
            "completion_tokens_details": None,
        },
        "prompt_logprobs": None,
        "prompt_token_id_logprobs": None,
        "prompt_token_ids": None,
        "mm_placeholders": None,
        "metrics": None,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "output_mode": "tokens",
        "choices": [
            {
                "index": 0,
                "finish_reason": "stop",
                "stop_reason": None,
                "token_ids": list(completion),
                "routed_experts": routed_value,
                "sampling_mask": None,
                "weight_versions": [{"version": "default", "start": 0, "end": len(completion)}],
                "logprobs": {"content": content},
            }
        ],
    }
    return json.dumps(body, separators=(",", ":")).encode()


def stream_events(completion: Sequence[int], *, prompt_tokens: int = PROMPT_TOKENS, seed: int = 0) -> list[bytes]:
    """The Server-Sent Events of ``/inference/v1/generate`` with ``"stream": true`` and ``stream_options.
    include_usage`` for the same sample as :func:`generate_body` (same ids, same logprob entries): as vLLM 0.32
    sends them, one ``data: {chunk}\\n\\n`` per engine step of one token (each chunk's one choice with its new
    ``token_ids`` and their ``logprobs.content``; finish and stop reasons and ``weight_versions`` on the chunk of
    the last token), then the usage chunk (no choices), then ``data: [DONE]``."""
    rng = random.Random(seed)
    events = []
    for i, t in enumerate(completion):
        lp = -rng.random() * 3
        last = i == len(completion) - 1
        choice = {
            "index": 0,
            "finish_reason": "stop" if last else None,
            "stop_reason": None,
            "token_ids": [t],
            "routed_experts": None,
            "sampling_mask": None,
            "weight_versions": [{"version": "default", "start": 0, "end": len(completion)}] if last else None,
            "logprobs": {
                "content": [{"token": f"token_id:{t}", "token_id": t, "logprob": lp, "rank": 1, "top_logprobs": []}]
            },
        }
        chunk = {"request_id": "generate-tokens-bench", "usage": None, "output_mode": "tokens", "choices": [choice]}
        events.append(chunk)
    usage = {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + len(completion),
        "completion_tokens": len(completion),
    }
    events.append({"request_id": "generate-tokens-bench", "usage": usage, "output_mode": "tokens", "choices": []})
    out = [b"data: " + json.dumps(e, separators=(",", ":")).encode() + b"\n\n" for e in events]
    return [*out, b"data: [DONE]\n\n"]


def models_body(max_model_len: int = 1 << 20) -> bytes:
    return json.dumps(
        {"object": "list", "data": [{"id": MODEL, "object": "model", "max_model_len": max_model_len, "parent": None}]}
    ).encode()


# -- the instant server (a separate process) --------------------------------------------------------------


def admin_calls(url: str) -> int:
    """Admin requests the emulated servers of ``instant.py --admin N`` answered so far, all together (``url``: any
    of them)."""
    import httpx

    return int(httpx.get(url + "/bench/stats").json()["admin"])


class ServerProcess:
    """``bench/instant.py`` in its own process (pinned to core 1 on a 2-core machine); ``ports`` maps the
    server's names (``plain``, ``re``, ``re_obj``, ``hold``, ``admin0``…) to their ports."""

    def __init__(self, *args: str) -> None:
        env = dict(os.environ)
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "instant.py"), *args],
            stdout=subprocess.PIPE,
            env=env,
            text=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("bench server did not start")
        self.ports: dict[str, int] = json.loads(line)

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.ports[name]}"

    def close(self) -> None:
        if self.proc.poll() is not None:
            print(f"bench server had exited with {self.proc.returncode}", file=sys.stderr)
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
