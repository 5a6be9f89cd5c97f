"""Client overhead per generate call against the instant server (a separate process).

    uv run python bench/bench_client.py [--rounds 5] [--n1 200] [--nc 640] [--out client]

For every body (``plain``: 256 completion tokens with logprobs; ``re``: + routed experts of a 1,024-token prompt,
48 layers, top-8) and concurrency (1 and 64) it measures client CPU per call (``time.process_time``, all threads)
and calls/s of:

* ``floor_raw``: asyncio streams, one keep-alive connection per worker, pre-built request bytes + ``json.loads``
  (what any Python client must at least pay);
* ``floor_httpx``: ``httpx.AsyncClient`` POST of a pre-built body + ``json.loads(r.content)`` (the issue's floor);
* ``floor_lean`` / ``floor_aiohttp``: the same on the hand-written transport the client used before aiohttp
  (``lean_transport.py``) / on a bare ``aiohttp.ClientSession``;
* ``ours_ids`` / ``ours_msgs``: ``Client.generate(prompt_ids=…)`` / ``(messages=…)`` on the vLLM backend (render
  included; routed experts requested and decoded into numpy for ``re``), library-default pool settings;
  ``ours_ids_lean`` / ``ours_ids_httpx`` / ``ours_ids_aiohttp``: ``ours_ids`` on the hand-written transport / on
  httpx's default transport / on the ``httpx-aiohttp`` package's transport (``ours_ids`` runs on the library's
  own adapter over ``aiohttp``);
* ``renderers_ids`` / ``renderers_msgs``: ``renderers.generate`` 0.1.12 (``Qwen3Renderer``, ``AsyncOpenAI`` with
  max_retries=0, pool 1000/100, keep-alive 3600 s, as in shared/PERF_BASELINE.md). For ``re`` it gets the
  object form of routed experts its splice parser recognises (it returns them undecoded, as base64);
* ``ours_msgs_vary`` / ``renderers_msgs_vary``: ``ours_msgs`` / ``renderers_msgs`` over a pool of 64 chats that
  share the first five messages and differ in the last user message (each rendering to the same 1,024 ids),
  used round-robin: a rollout batch's shared prefix, never a whole-prompt repeat (the prefix cache's first use,
  which renders twice and tokenizes the text whole and in two pieces, falls in the unmeasured warm-up).
  ``ours_msgs`` renders through the client's default render (its prefix cache on); ``ours_msgs_nocache`` /
  ``ours_msgs_vary_nocache`` (run only when named in ``--clients``) turn it off: the whole text is tokenized
  each call, the render as it was before the cache.

Each batch gets its own client (pool) and an unmeasured warm-up of 2×concurrency calls; batches run in a
shuffled order each round; ratios are taken per round (same round, body, concurrency), then median [min-max].
The client is pinned to core 0 and the server to core 1 on a 2-core machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import _common as c

Call = Callable[[], Awaitable[Any]]
Factory = Callable[[], Awaitable[tuple[Call, Callable[[], Awaitable[None]]]]]

CLIENTS = (
    "floor_raw",
    "floor_httpx",
    "floor_lean",
    "floor_aiohttp",
    "ours_ids",
    "ours_ids_lean",
    "ours_ids_httpx",
    "ours_ids_aiohttp",
    "ours_msgs",
    "ours_msgs_vary",
    "renderers_ids",
    "renderers_msgs",
    "renderers_msgs_vary",
)


class Fixture:
    def __init__(self) -> None:
        self.tok = c.tokenizer()
        self.messages = c.chat_messages(self.tok)
        self.prompt_ids = c.render_ids(self.tok, self.messages)
        self.completion = c.completion_ids(self.tok)
        self.stop = c.stop_token_ids(self.tok)
        request = {
            "model": c.MODEL,
            "token_ids": self.prompt_ids,
            "sampling_params": {
                "max_tokens": c.COMPLETION_TOKENS,
                "temperature": 1.0,
                "stop_token_ids": self.stop,
                "logprobs": 1,
                "skip_special_tokens": False,
            },
        }
        self.request_body = json.dumps(request, separators=(",", ":")).encode()
        self.variants = c.chat_variants(self.tok)
        self.variant_ids = [c.render_ids(self.tok, m) for m in self.variants]


def make_factory(name: str, url: str, body: str, fx: Fixture) -> Factory:
    routed = body == "re"

    if name == "floor_raw":

        async def factory() -> tuple[Call, Callable[[], Awaitable[None]]]:
            host, port = url.removeprefix("http://").split(":")
            head = (
                f"POST /inference/v1/generate HTTP/1.1\r\nhost: {host}:{port}\r\ncontent-type: application/json\r\n"
                f"content-length: {len(fx.request_body)}\r\n\r\n"
            ).encode()
            request = head + fx.request_body
            idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
            opened: list[asyncio.StreamWriter] = []

            async def call() -> Any:
                if idle:
                    reader, writer = idle.pop()
                else:
                    reader, writer = await asyncio.open_connection(host, int(port), limit=1 << 24)
                    opened.append(writer)
                writer.write(request)
                head = await reader.readuntil(b"\r\n\r\n")
                at = head.lower().find(b"content-length:")
                length = int(head[at + 15 : head.find(b"\r\n", at)])
                data = json.loads(await reader.readexactly(length))
                idle.append((reader, writer))
                return data

            async def close() -> None:
                for w in opened:
                    w.close()

            return call, close

        return factory

    if name in ("floor_httpx", "floor_lean"):

        async def factory() -> tuple[Call, Callable[[], Awaitable[None]]]:
            import httpx
            from lean_transport import LeanTransport

            limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100, keepalive_expiry=3600)
            mounts = {"http://": LeanTransport(limits=limits)} if name == "floor_lean" else None
            client = httpx.AsyncClient(limits=limits, mounts=mounts, timeout=httpx.Timeout(60.0))
            target = url + "/inference/v1/generate"
            headers = {"content-type": "application/json"}

            async def call() -> Any:
                r = await client.post(target, content=fx.request_body, headers=headers)
                return json.loads(r.content)

            return call, client.aclose

        return factory

    if name == "floor_aiohttp":

        async def factory() -> tuple[Call, Callable[[], Awaitable[None]]]:
            import aiohttp

            connector = aiohttp.TCPConnector(limit=1000, keepalive_timeout=3600)
            session = aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60.0))
            target = url + "/inference/v1/generate"
            headers = {"content-type": "application/json"}

            async def call() -> Any:
                async with session.post(target, data=fx.request_body, headers=headers) as r:
                    return json.loads(await r.read())

            return call, session.close

        return factory

    if name.startswith("ours"):

        async def factory() -> tuple[Call, Callable[[], Awaitable[None]]]:
            from backends_core import Client, ClientConfig, SamplingParams

            config = ClientConfig(backend="vllm", base_url=url, model=c.MODEL)
            transport = None
            if name in ("ours_ids_lean", "ours_ids_httpx", "ours_ids_aiohttp"):  # another transport, same limits
                import httpx
                from httpx_aiohttp import AiohttpTransport
                from lean_transport import LeanTransport

                lim = config.limits
                limits = httpx.Limits(
                    max_connections=lim.max_connections,
                    max_keepalive_connections=lim.max_keepalive_connections,
                    keepalive_expiry=lim.keepalive_expiry,
                )
                kinds: dict[str, Any] = {
                    "ours_ids_lean": LeanTransport,
                    "ours_ids_httpx": httpx.AsyncHTTPTransport,
                    "ours_ids_aiohttp": AiohttpTransport,
                }
                transport = kinds[name](limits=limits)
            client = Client(config, tokenizer=fx.tok, transport=transport)
            client.render_cache.enabled = not name.endswith("_nocache")
            sampling = SamplingParams(max_tokens=c.COMPLETION_TOKENS, temperature=1.0, stop_token_ids=fx.stop)
            vary = "_vary" in name
            turn = iter(range(1 << 62))
            if name.startswith("ours_ids"):
                kwargs: dict[str, Any] = {"prompt_ids": fx.prompt_ids}
            else:
                kwargs = {"messages": fx.messages}

            async def call() -> Any:
                if vary:
                    kwargs["messages"] = fx.variants[next(turn) % len(fx.variants)]
                return await client.generate(sampling=sampling, return_routed_experts=routed, **kwargs)

            result = await call()
            expected = fx.variant_ids[0] if vary else fx.prompt_ids
            assert list(result.completion_ids) == fx.completion and list(result.prompt_ids) == expected
            assert (result.routed_experts is not None) == routed
            return call, client.aclose

        return factory

    if name.startswith("renderers"):

        async def factory() -> tuple[Call, Callable[[], Awaitable[None]]]:
            import httpx2
            import openai
            from renderers import Qwen3Renderer
            from renderers.client import generate as renderers_generate

            http = openai.DefaultAsyncHttpxClient(
                limits=httpx2.Limits(max_connections=1000, max_keepalive_connections=100, keepalive_expiry=3600),
                timeout=httpx2.Timeout(60.0),
            )
            oc = openai.AsyncOpenAI(base_url=url + "/v1", api_key="bench", max_retries=0, http_client=http)
            renderer = Qwen3Renderer(fx.tok)
            sampling = {"max_tokens": c.COMPLETION_TOKENS, "temperature": 1.0}
            ids = fx.prompt_ids if name == "renderers_ids" else None
            vary = "_vary" in name
            turn = iter(range(1 << 62))

            async def call() -> Any:
                messages = fx.variants[next(turn) % len(fx.variants)] if vary else fx.messages
                return await renderers_generate(
                    client=oc,
                    renderer=renderer,
                    messages=messages,
                    model=c.MODEL,
                    prompt_ids=ids,
                    sampling_params=sampling,
                )

            result = await call()
            expected = fx.variant_ids[0] if vary else fx.prompt_ids
            assert result["completion_ids"] == fx.completion and result["prompt_ids"] == expected
            return call, oc.close

        return factory

    raise ValueError(name)


async def run_calls(call: Call, n: int, conc: int) -> None:
    remaining = iter(range(n))

    async def worker() -> None:
        for _ in remaining:
            await call()

    await asyncio.gather(*(worker() for _ in range(conc)))


async def measure(factory: Factory, n: int, conc: int) -> tuple[float, float]:
    call, close = await factory()
    try:
        await run_calls(call, 2 * conc, conc)
        cpu0, wall0 = time.process_time(), time.perf_counter()
        await run_calls(call, n, conc)
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    finally:
        await close()
    return cpu / n * 1e6, n / wall


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--n1", type=int, default=200, help="calls per batch at concurrency 1")
    parser.add_argument("--nc", type=int, default=640, help="calls per batch at concurrency 64")
    parser.add_argument("--clients", default=",".join(CLIENTS))
    parser.add_argument("--bodies", default="plain,re")
    parser.add_argument("--conc", default="1,64")
    parser.add_argument("--out", default="client")
    args = parser.parse_args()
    c.pin(0)
    fx = Fixture()
    clients = args.clients.split(",")
    bodies = args.bodies.split(",")
    concs = [int(x) for x in args.conc.split(",")]
    data: dict[str, Any] = {"machine": c.machine(), "args": vars(args), "rounds": []}
    with c.ServerProcess() as server:
        batches = [(cl, b, k) for cl in clients for b in bodies for k in concs]
        for r in range(args.rounds):
            results: dict[str, list[float]] = {}
            for cl, b, k in c.shuffled(batches, r):
                port = "re_obj" if b == "re" and cl.startswith("renderers") else b
                factory = make_factory(cl, server.url(port), b, fx)
                cpu, rate = await measure(factory, args.n1 if k == 1 else args.nc, k)
                results[f"{cl}|{b}|{k}"] = [cpu, rate]
            data["rounds"].append(results)
            print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    c.save(args.out, data)
    print(report(data, clients, bodies, concs))


def report(data: dict[str, Any], clients: list[str], bodies: list[str], concs: list[int]) -> str:
    rounds = data["rounds"]
    pairs = [
        ("floor_httpx", "floor"),
        ("floor_raw", "raw"),
        ("ours_ids_httpx", "ours_httpx"),
        ("ours_ids_lean", "lean"),
        ("renderers_ids", "rend_ids"),
        ("renderers_msgs", "rend_msgs"),
        ("renderers_msgs_vary", "rend_msgs_vary"),
    ]
    pairs = [(p, label) for p, label in pairs if p in clients]
    headers = ["body", "conc", "client", "CPU µs/call", "calls/s", *[f"CPU ÷ {label}" for _, label in pairs]]
    rows = []
    for b in bodies:
        for k in concs:
            for cl in clients:
                key = f"{cl}|{b}|{k}"
                cpu = [rd[key][0] for rd in rounds]
                rate = [rd[key][1] for rd in rounds]
                ratios = [c.ratio_summary([rd[key][0] / rd[f"{p}|{b}|{k}"][0] for rd in rounds]) for p, _ in pairs]
                rows.append([b, k, cl, c.summary(cpu), c.summary(rate), *ratios])
    m = data["machine"]
    return f"{m['date']} · {m['cpu']} · {m['cores']} cores · {m['cpu_pressure_at_start']}\n" + c.table(headers, rows)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--report":
        with open(sys.argv[2]) as f:
            d = json.load(f)
        a = d["args"]
        print(report(d, a["clients"].split(","), a["bodies"].split(","), [int(x) for x in a["conc"].split(",")]))
    else:
        asyncio.run(main())
