"""Routed-experts parse: MB/s of whole response bodies turned into a numpy ``[tokens, 48, 8]`` array.

    uv run python bench/bench_decode.py [--rounds 9]

In-process, no HTTP. Bodies: a full ``/inference/v1/generate`` answer (256 completion tokens with logprob
entries) carrying routed experts of 4,096 and 32,768 rows. Methods, interleaved in every round:

* ``floor_memcpy``: a copy of the whole body (``bytearray``): what touching every byte once costs;
* ``floor_pybase64``: ``pybase64.b64decode`` (validating) of the routed-experts text alone, already located,
  + ``np.frombuffer``: the decode any client must do, with nothing else;
* ``stdlib``: ``json.loads`` + ``base64.b64decode`` + ``np.frombuffer`` (vLLM's string form, ``.npy`` inside);
* ``renderers``: renderers 0.1.12's splice parser ``parse_generate_response`` (object form, which it needs) +
  ``base64.b64decode`` of its memoryview + ``np.frombuffer``;
* ``ours_decode``: what ``Server.request`` does with the body (``loads_lifting`` with the ``.npy`` header sizing
  the payload: the text stays a memoryview of the body) + ``decode_routed_experts``;
* ``ours_full``: the same + the vLLM backend's whole ``parse_generate`` (ids, logprobs, checks): what a generate
  call really costs after the bytes arrive;
* ``ours_sglang``: SGLang's form, raw little-endian int32 in ``meta_info.routed_experts`` (4 bytes per id, so a
  body about 4× larger), lifted by scanning for its closing quote (raw bytes carry no length) + decoded;
* ``ours_dynamo``: Dynamo's form, ``{"data", "shape", "dtype"}`` (uint8), ``data`` lifted by scanning for its
  closing quote (raw bytes carry no length) + decoded.

MB = 10^6 bytes of the whole body (each method's own body). Every method's array is checked equal to the
expected one (int32 for SGLang's form). ``peak alloc`` is the tracemalloc peak during one call over the decoded
size: 1.0 means exactly one copy of the decoded bytes and nothing else of that size.
"""

from __future__ import annotations

import argparse
import base64
import json
import statistics
import tracemalloc
from collections.abc import Callable
from typing import Any

import _common as c
import numpy as np

from backends_core import SamplingParams

SIZES = (4096, 32768)


def sglang_body(completion: list[int], rows: int) -> bytes:
    """An SGLang ``/generate`` answer with ``meta_info.routed_experts`` (raw int32, base64), as SGLang 0.5.23
    sends it."""
    raw = c.experts_array(rows).astype("<i4").tobytes()
    body = {
        "text": "",
        "output_ids": completion,
        "meta_info": {
            "id": "bench",
            "finish_reason": {"type": "length", "length": len(completion)},
            "prompt_tokens": rows + 1 - len(completion),
            "completion_tokens": len(completion),
            "cached_tokens": 0,
            "output_token_logprobs": [[-0.5, t, None] for t in completion],
            "weight_version": "default",
            "routed_experts": base64.b64encode(raw).decode("ascii"),
        },
    }
    return json.dumps(body, separators=(",", ":")).encode()


def methods(rows: int, tok: Any) -> tuple[dict[str, Callable[[], np.ndarray]], dict[str, int]]:
    import pybase64
    from renderers.client import parse_generate_response

    from backends_core.jsonio import loads_lifting
    from backends_core.routed_experts import decode_routed_experts, npy_base64_length
    from backends_core.types import GenerateRequest
    from backends_vllm import wire

    completion = c.completion_ids(tok)
    prompt_tokens = rows + 1 - len(completion)
    npy_body = c.generate_body(completion, prompt_tokens=prompt_tokens, routed="npy", rows=rows)
    obj_body = c.generate_body(completion, prompt_tokens=prompt_tokens, routed="object", rows=rows)
    sg_body = sglang_body(completion, rows)
    request = GenerateRequest(
        prompt_ids=[1] * prompt_tokens, return_routed_experts=True, sampling=SamplingParams(max_tokens=16)
    )
    keys = ("routed_experts",)
    start = npy_body.index(b'"routed_experts":"') + len(b'"routed_experts":"')
    text = memoryview(npy_body)[start : npy_body.index(b'"', start)]

    expected = c.experts_array(rows)

    def floor_memcpy() -> np.ndarray:
        bytearray(npy_body)
        return expected  # the copy is what is timed; the array only passes the equality check

    def floor_pybase64() -> np.ndarray:
        raw = pybase64.b64decode(text, validate=True)
        header = int.from_bytes(raw[8:10], "little") + 10
        return np.frombuffer(raw, np.uint8, offset=header).reshape(rows, c.LAYERS, c.TOP_K)

    def stdlib() -> np.ndarray:
        data = json.loads(npy_body)
        raw = base64.b64decode(data["choices"][0]["routed_experts"])
        header = int.from_bytes(raw[8:10], "little") + 10
        return np.frombuffer(raw, np.uint8, offset=header).reshape(rows, c.LAYERS, c.TOP_K)

    def renderers() -> np.ndarray:
        data = parse_generate_response(obj_body)
        routed = data["choices"][0]["routed_experts"]
        return np.frombuffer(base64.b64decode(routed["data"]), np.uint8).reshape(routed["shape"])

    def ours_decode() -> np.ndarray:
        data = loads_lifting(npy_body, keys, sized=npy_base64_length)
        return decode_routed_experts(data["choices"][0]["routed_experts"])

    def ours_full() -> np.ndarray:
        parsed = loads_lifting(npy_body, keys, sized=npy_base64_length)
        (result,) = wire.parse_generate(parsed, request, "http://bench")
        assert result.routed_experts is not None
        return result.routed_experts.experts

    def ours_sglang() -> np.ndarray:
        data = loads_lifting(sg_body, keys, sized=npy_base64_length)
        payload = data["meta_info"]["routed_experts"]
        return decode_routed_experts(payload, num_layers=c.LAYERS, top_k=c.TOP_K, dtype="int32")

    def ours_dynamo() -> np.ndarray:
        routed = loads_lifting(obj_body, ("routed_experts", "data"), sized=npy_base64_length)
        routed = routed["choices"][0]["routed_experts"]
        shape = routed["shape"]
        return decode_routed_experts(routed["data"], num_layers=shape[1], top_k=shape[2], dtype=routed["dtype"])

    fns = {
        "floor_memcpy": floor_memcpy,
        "floor_pybase64": floor_pybase64,
        "stdlib": stdlib,
        "renderers": renderers,
        "ours_decode": ours_decode,
        "ours_full": ours_full,
        "ours_sglang": ours_sglang,
        "ours_dynamo": ours_dynamo,
    }
    sizes = {name: len(npy_body) for name in fns}
    sizes.update(renderers=len(obj_body), ours_dynamo=len(obj_body), ours_sglang=len(sg_body))
    return fns, sizes


def peak_ratio(fn: Callable[[], np.ndarray], decoded: int) -> float:
    tracemalloc.start()
    tracemalloc.reset_peak()
    out = fn()
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    del out
    return peak / decoded


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    c.pin(0)
    tok = c.tokenizer()
    data: dict[str, Any] = {"machine": c.machine(), "rounds": args.rounds, "sizes": {}}
    rows_out = []
    for rows in SIZES:
        fns, sizes = methods(rows, tok)
        expected = c.experts_array(rows)
        for name, fn in fns.items():
            assert np.array_equal(fn(), expected.astype("<i4") if name == "ours_sglang" else expected), name
        times: dict[str, list[float]] = {name: [] for name in fns}
        for r in range(args.rounds):
            for name in c.shuffled(list(fns), r):
                times[name].append(c.timeit_us(fns[name], min_time=0.3) / 1e3)
        decoded = expected.nbytes
        peaks = {
            name: peak_ratio(fn, decoded * (4 if name == "ours_sglang" else 1))
            for name, fn in fns.items()
            if name != "floor_memcpy"
        }
        speedup = {name: [times["renderers"][i] / times[name][i] for i in range(args.rounds)] for name in fns}
        data["sizes"][rows] = {"times_ms": times, "body_bytes": sizes, "peak_over_decoded": peaks}
        for name in fns:
            mbs = sizes[name] / 1e6 / (statistics.median(times[name]) / 1e3)
            rows_out.append(
                [
                    f"[{rows},48,8] ({sizes[name] / 1e6:.2f} MB)",
                    name,
                    c.summary(times[name], "{:.3f}"),
                    f"{mbs:.0f}",
                    c.ratio_summary(speedup[name]),
                    f"{peaks[name]:.2f}" if name in peaks else "",
                ]
            )
    c.save("decode", data)
    m = data["machine"]
    print(f"{m['date']} · {m['cpu']} · {m['cores']} cores · {m['cpu_pressure_at_start']}")
    print(
        c.table(["payload (body)", "method", "ms", "MB/s", "speed-up vs renderers", "peak alloc ÷ decoded"], rows_out)
    )


if __name__ == "__main__":
    main()
