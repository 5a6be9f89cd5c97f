"""Multi-turn prompt construction: µs to build turn t's prompt ids at t = 1, 10, 50.

    uv run python bench/bench_multiturn.py [--rounds 5] [--profile]

In-process, the tiny tokenizer (byte-level BPE, Qwen3-style template). A turn is a user message of ~50 tokens and
an assistant answer of ~200 tokens; turn t's prompt is [u1, a1, …, u(t-1), a(t-1), u(t)] + the generation prompt.

* ``full_render``: ``apply_chat_template`` of the whole conversation + encode (what a client without a bridge pays);
* ``bridge``: ``multiturn.extension.extend_prompt`` (what ``Conversation.send`` runs): previous prompt + previous
  completion ids reused untouched, only the new user message rendered (t = 1: ``render_text`` + ``encode`` of [u1],
  the core's default ``render`` hook, which the first ``send`` runs);
* ``stateless``: ``TurnCache.prompt_ids`` (``client.generate(messages=…, session=…)``): the whole message list is
  normalised (the prefix the session sent last turn by one comparison, the two new dicts afresh) and matched
  against the remembered turns, then bridged (t = 1: as ``bridge``).

Each round times t = 1, 10 and 50 of one method with their calls interleaved (≥ 0.6 s), so a round's t=50 ÷ t=1
compares calls made under the same load; the machine is shared and noisy.

Every method's ids are checked identical to ``full_render`` at every measured turn, on the first call (for the
bridge: the call that verifies the tail render against a full one) and on a second call (the bridge's steady
state: a tail render); the bridge's render counts (``tail_renders`` / ``full_renders``) are printed and saved.
With ``--profile``, a cProfile summary of ``extend_prompt`` at turn 50 is printed (quoted in bench/README.md).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import subprocess
import sys
import time
import types
from typing import Any

import _common as c
import numpy as np

TURNS = (1, 10, 50)


def conversation(tok: Any, turns: int) -> tuple[list[dict[str, str]], list[list[int]]]:
    """Messages [u1, a1, …, u(turns)] and each assistant turn's completion ids (its text + ``<|im_end|>``)."""
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    messages: list[dict[str, str]] = []
    completions: list[list[int]] = []
    for t in range(turns):
        messages.append({"role": "user", "content": c._text(25, 100 + t)})
        if t < turns - 1:
            text = c._text(100, 200 + t)
            messages.append({"role": "assistant", "content": text})
            completions.append([*tok.encode(text, add_special_tokens=False), im_end])
    return messages, completions


def _renders_since(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    full = {k: v - before["full_renders"].get(k, 0) for k, v in after["full_renders"].items()}
    return {"tail": after["tail_renders"] - before["tail_renders"], "full": {k: v for k, v in full.items() if v}}


def _load_before(rev: str) -> tuple[Any, Any, Any]:
    """``bridge``, ``stateless`` and ``messages`` as of git revision ``rev``, loaded as private modules next to
    today's (the rest of the package is today's)."""
    modules = {}
    for name in ("messages", "bridge", "stateless"):
        path = f"backends_core/src/backends_core/{name}.py"
        code = subprocess.run(
            ["git", "show", f"{rev}:{path}"], capture_output=True, text=True, check=True, cwd=c.HERE.parent
        ).stdout
        for dep in ("messages", "bridge"):
            code = code.replace(f"from backends_core.{dep} import", f"from _before_{dep} import")
        module = types.ModuleType(f"_before_{name}")
        sys.modules[module.__name__] = module
        exec(compile(code, f"{rev}:{path}", "exec"), module.__dict__)  # our own file at REV
        modules[name] = module
    return modules["bridge"], modules["stateless"], modules["messages"]


def _interleaved_us(fns: dict[int, Any], *, min_time: float, seed: int) -> dict[int, float]:
    """Mean µs per call of each turn's function, calls of the turns interleaved (shuffled order each pass), so
    the t=50 ÷ t=1 ratio of one round compares calls made under the same load."""
    for fn in fns.values():
        fn()
    total = dict.fromkeys(fns, 0.0)
    calls = dict.fromkeys(fns, 0)
    started = time.perf_counter()
    passes = 0
    while passes < 3 or time.perf_counter() - started < min_time:
        for t in c.shuffled(list(fns), seed * 1000 + passes):
            t0 = time.perf_counter()
            fns[t]()
            total[t] += time.perf_counter() - t0
            calls[t] += 1
        passes += 1
    return {t: total[t] / calls[t] * 1e6 for t in fns}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument(
        "--before", metavar="REV", help="also time the bridge and the stateless cache as of git revision REV"
    )
    args = parser.parse_args()
    c.pin(0)
    from backends_core.config import StatelessPolicy
    from backends_core.multiturn.extension import BridgeStats, clear_template_cache, extend_prompt
    from backends_core.multiturn.messages import normalize_messages
    from backends_core.multiturn.rendering import encode, render_text
    from backends_core.multiturn.turn_cache import TurnCache
    from backends_core.parsing import CompletionParser
    from backends_core.types import GenerateResult

    tok = c.tokenizer()
    clear_template_cache()
    stats = BridgeStats()
    ours_first = lambda m: encode(tok, render_text(tok, m))  # noqa: E731 - the core's default render hook
    cases: dict[int, dict[str, Any]] = {}
    for t in TURNS:
        messages, completions = conversation(tok, t)
        full = c.render_ids(tok, messages)
        if t == 1:
            fns = {
                "full_render": lambda m=messages: c.render_ids(tok, m),
                "bridge": lambda m=messages: ours_first(m),
                "stateless": lambda m=messages: ours_first(m),
            }
        else:
            prev_msgs = messages[:-2]
            prev_prompt = c.render_ids(tok, prev_msgs)
            prev = GenerateResult(
                prompt_ids=tuple(prev_prompt),
                completion_ids=tuple(completions[-1]),
                logprobs=np.zeros(len(completions[-1]), np.float32),
                finish_reason="stop",
            )
            cache = TurnCache(
                StatelessPolicy(), parse=CompletionParser(tok, tool_parser=None, reasoning_parser=None).parse
            )
            cache.remember("s", normalize_messages(prev_msgs), prev)
            cache._normalize("s", prev_msgs)  # what turn t-1's call left in the session
            seen = cache._seen["s"]  # the session saw turn t-1's list; every timed call starts from there

            def stateless(cache: TurnCache = cache, m: list[Any] = messages, seen: Any = seen) -> Any:
                cache._seen["s"] = (list(seen[0]), list(seen[1]))
                new = [*m[:-2], *map(dict, m[-2:])]  # the caller appends two new dicts (assistant, user)
                return cache.prompt_ids(tok, "s", new, tools=None, chat_template_kwargs=None, stats=stats)

            fns = {
                "full_render": lambda m=messages: c.render_ids(tok, m),
                "bridge": lambda h=prev_msgs, p=prev, m=messages: extend_prompt(
                    tok, history=h, previous=p, new_messages=m[-1:], stats=stats
                ),
                "stateless": stateless,
            }
        before = stats.as_dict()
        for name, fn in fns.items():
            for call in ("first", "steady"):
                assert fn() == full, (t, name, call)
        cases[t] = {"fns": fns, "tokens": len(full), "renders": _renders_since(before, stats.as_dict())}
    names = ["full_render", "bridge", "stateless"]
    if args.before:
        names += [f"bridge @{args.before}", f"stateless @{args.before}"]
        old_bridge, old_stateless, old_messages = _load_before(args.before)
        for t in TURNS:
            messages, completions = conversation(tok, t)
            full = c.render_ids(tok, messages)
            fns = cases[t]["fns"]
            if t == 1:
                fns[names[3]] = fns[names[4]] = lambda m=messages: ours_first(m)
            else:
                prev_msgs = messages[:-2]
                prev = GenerateResult(
                    prompt_ids=tuple(c.render_ids(tok, prev_msgs)),
                    completion_ids=tuple(completions[-1]),
                    logprobs=np.zeros(len(completions[-1]), np.float32),
                    finish_reason="stop",
                )
                old_cache = old_stateless.TurnCache(StatelessPolicy())
                old_cache.remember("s", old_messages.normalize_messages(prev_msgs), prev)
                fns[names[3]] = lambda h=prev_msgs, p=prev, m=messages: old_bridge.extend_prompt(
                    tok, history=h, previous=p, new_messages=m[-1:]
                )
                fns[names[4]] = lambda cache=old_cache, m=messages: cache.prompt_ids(
                    tok, "s", [*m[:-2], *map(dict, m[-2:])], tools=None, chat_template_kwargs=None
                )
            for name in names[3:]:
                assert fns[name]() == full, (t, name)
    times: dict[str, dict[int, list[float]]] = {n: {t: [] for t in TURNS} for n in names}
    for r in range(args.rounds):
        for name in c.shuffled(names, r):
            per_turn = _interleaved_us({t: cases[t]["fns"][name] for t in TURNS}, min_time=0.6, seed=r)
            for t in TURNS:
                times[name][t].append(per_turn[t])
    rows = []
    for name in names:
        growth = [times[name][50][i] / times[name][1][i] for i in range(args.rounds)]
        rows.append([name, *[c.summary(times[name][t]) for t in TURNS], c.ratio_summary(growth)])
    renders = {t: cases[t]["renders"] for t in TURNS}
    m = c.machine()
    c.save(
        "multiturn",
        {"machine": m, "times_us": times, "tokens": {t: cases[t]["tokens"] for t in TURNS}, "renders": renders},
    )
    print(f"{m['date']} · {m['cpu']} · {m['cores']} cores · {m['cpu_pressure_at_start']}")
    heads = ["method", *[f"t={t} ({cases[t]['tokens']} tok) µs" for t in TURNS], "t=50 ÷ t=1"]
    print(c.table(heads, rows))
    print("bridge + stateless renders during the two checked calls per turn:", renders)
    if args.profile:
        fn = cases[50]["fns"]["bridge"]
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(50):
            fn()
        profile.disable()
        out = io.StringIO()
        pstats.Stats(profile, stream=out).sort_stats("cumulative").print_stats(18)
        print("\n".join(line for line in out.getvalue().splitlines() if line.strip()))


if __name__ == "__main__":
    main()
