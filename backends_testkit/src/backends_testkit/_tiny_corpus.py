"""Deterministic built-in text corpus used to train the tiny models' BPE tokenizer."""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator

__all__ = ["corpus_lines"]

_CORPUS_SEED = 20251121
_LINES_PER_KIND = 600


def _words(text: str) -> tuple[str, ...]:
    return tuple(text.split())


_NOUNS = _words(
    "model server client request response token batch engine weight adapter layer expert router cache "
    "prompt reply message system user assistant tool function argument value result error status queue "
    "worker thread process memory kernel device tensor matrix vector scalar shape index offset length "
    "window buffer stream socket header payload schema field record table column row file path folder "
    "river mountain forest garden window kitchen teacher student library market city village island "
    "ocean planet rocket engine bridge tower castle museum doctor friend family morning evening winter "
    "summer spring autumn coffee bread apple orange letter number answer question problem reason story "
    "picture country government company program language computer network science history music "
    "animal weather holiday journey picture harvest lantern blanket pocket ribbon saddle thunder "
    "whisper compass harbor meadow orchard pebble quarry canyon glacier volcano desert prairie"
)
_VERBS = _words(
    "runs sends returns reads writes loads stores builds checks starts stops waits pauses resumes "
    "computes samples decodes encodes renders parses streams answers explains follows carries opens "
    "closes finds keeps moves turns grows learns teaches travels visits watches paints counts measures "
    "remembers imagines discovers describes collects protects prepares delivers improves organizes "
    "celebrates compares considers develops"
)
_ADJECTIVES = _words(
    "small large quick slow bright dark early late simple careful random stable tiny useful green blue "
    "red quiet loud warm cold new old empty full happy busy lazy honest clever strange modern ancient "
    "beautiful dangerous important wonderful curious gentle narrow shallow famous generous nervous"
)
_ADVERBS = _words("quickly slowly carefully quietly often rarely always never gently suddenly again")
_NAMES = _words("Alice Bob Carol Dave Erin Frank Grace Heidi Ivan Judy Mallory Niaj Olivia Peggy Rupert Sybil")
_PLACES = _words("Paris London Tokyo Berlin Madrid Rome Oslo Cairo Lima Delhi Seoul Sydney Toronto Vienna")
_IDENTS = _words(
    "count total items values result config request response tokens logits weights index offset "
    "length name path data text prompt batch state cache size limit seed step epoch loss score"
)
_TOOLS = _words(
    "get_weather search_web read_file write_file run_python lookup_user send_email add_numbers "
    "list_files get_time translate_text"
)


def _sentence(rng: random.Random) -> str:
    subject = rng.choice(
        (
            f"The {rng.choice(_ADJECTIVES)} {rng.choice(_NOUNS)}",
            rng.choice(_NAMES),
            f"A {rng.choice(_NOUNS)} in {rng.choice(_PLACES)}",
            f"Every {rng.choice(_NOUNS)}",
        )
    )
    obj = f"the {rng.choice(_ADJECTIVES)} {rng.choice(_NOUNS)}"
    tail = rng.choice(("", f" {rng.choice(_ADVERBS)}", f" in {rng.choice(_PLACES)}", f" with {obj}"))
    end = rng.choice((".", ".", ".", "!", "?"))
    return f"{subject} {rng.choice(_VERBS)} {obj}{tail}{end}"


def _english(rng: random.Random) -> str:
    return " ".join(_sentence(rng) for _ in range(rng.randint(1, 4)))


def _code(rng: random.Random) -> str:
    fn = f"{rng.choice(_VERBS)[:-1]}_{rng.choice(_IDENTS)}"
    args = ", ".join(rng.sample(_IDENTS, rng.randint(1, 3)))
    var = rng.choice(_IDENTS)
    body = rng.choice(
        (
            f"    {var} = len({args.split(', ')[0]})\n    return {var} * {rng.randint(2, 99)}",
            f"    for i in range({rng.randint(1, 64)}):\n        {var} += i\n    return {var}",
            f'    if {var} is None:\n        raise ValueError("missing {var}")\n    return {var}',
            f'    return {{"{var}": {args.split(", ")[0]}, "ok": True}}',
        )
    )
    if rng.random() < 0.3:
        return f"function {fn}({args}) {{\n  const {var} = {rng.randint(0, 999)};\n  return {var};\n}}"
    return f"def {fn}({args}):\n{body}\n"


def _json(rng: random.Random) -> str:
    obj: dict[str, object] = {
        rng.choice(_IDENTS): rng.randint(-1000, 100000),
        rng.choice(_IDENTS): round(rng.uniform(-100, 100), rng.randint(1, 4)),
        rng.choice(_IDENTS): rng.choice(_NAMES),
        rng.choice(_IDENTS): [rng.randint(0, 50) for _ in range(rng.randint(0, 5))],
        rng.choice(_IDENTS): rng.choice((True, False, None)),
    }
    return json.dumps(obj, indent=rng.choice((None, 2)))


def _numbers(rng: random.Random) -> str:
    year, month, day = rng.randint(1990, 2030), rng.randint(1, 12), rng.randint(1, 28)
    return rng.choice(
        (
            f"{rng.randint(0, 999)} + {rng.randint(0, 999)} = ?",
            f"The total is {rng.randint(1, 99999)} and the ratio is {rng.random():.3f}.",
            f"Date: {year}-{month:02d}-{day:02d} {rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}",
            f"{rng.randint(1, 9)}.{rng.randint(0, 99)}% of {rng.randint(100, 5000)} items",
            f"x = {rng.uniform(-10, 10):.4f}, y = {rng.uniform(-10, 10):.4f}",
        )
    )


def _chat(rng: random.Random) -> str:
    user = _english(rng)
    reply = _english(rng)
    if rng.random() < 0.3:
        call = {"name": rng.choice(_TOOLS), "arguments": {"city": rng.choice(_PLACES)}}
        reply = f"<tool_call>\n{json.dumps(call)}\n</tool_call>"
    elif rng.random() < 0.3:
        reply = f"<think>\n{_english(rng)}\n</think>\n\n{reply}"
    return f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n{reply}<|im_end|>\n"


_KINDS: tuple[Callable[[random.Random], str], ...] = (_english, _english, _code, _json, _numbers, _chat)


def corpus_lines() -> Iterator[str]:
    """Yield the training corpus: English, code, JSON, numbers and chat snippets.

    The corpus is fixed (independent of any model seed), so every build gets the same tokenizer.

    :returns: an iterator of text documents.
    """
    rng = random.Random(_CORPUS_SEED)
    for _ in range(_LINES_PER_KIND):
        for kind in _KINDS:
            yield kind(rng)
