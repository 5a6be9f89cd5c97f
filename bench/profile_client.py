"""cProfile of one client's generate calls against the instant server: where the client CPU goes.

    uv run python bench/profile_client.py [--client ours_ids] [--body plain] [--conc 1] [--n 400] [--top 25]
    uv run python bench/profile_client.py --admin 64 [--n 20] [--delay 0.05] [--sync]
    uv run python bench/profile_client.py --render [--n 400]
    uv run python bench/profile_client.py --client ours_stream [--conc 1] [--n 100]

Prints the functions with the most own CPU time (tottime) and cumulative time. Used for the bounds in bench/README.md.
``--admin N`` profiles ``n`` rounds of pause → update → resume over N emulated servers answering after ``--delay``
seconds (the fleet fan-out of ``bench_fleet.py``: 4 admin calls per server and round) instead of generate calls;
with ``--sync``, ``n`` rounds of ``admin.weight_sync`` instead (the calls per server counted from the emulator).
``--render`` times (``time.process_time``, no profiler, no HTTP) the pieces of the default render of
``bench_client.py``'s varying-last-message chats: the whole render through the prefix cache, the chat template
alone, tokenizing the whole text, tokenizing the part after the cached prefix, and the template over the last
message alone (what rendering only the tail would cost).
``--client ours_stream`` profiles ``bench_stream.py``'s streamed call (every delta consumed) on the plain body.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import pstats
import time

import _common as c
from bench_client import Fixture, make_factory, run_calls


def by_package(stats: pstats.Stats, total: float) -> list[tuple[str, float]]:
    """Own time grouped by where the code lives (site-packages package, our packages, the stdlib, C calls)."""
    shares: dict[str, float] = {}
    for (filename, _line, name), value in stats.stats.items():  # type: ignore[attr-defined]
        if "site-packages/" in filename:
            package = filename.split("site-packages/", 1)[1].split("/", 1)[0]
        elif "/backends_" in filename:  # our packages: backends_core, backends_vllm, backends_gateway...
            package = "backends_" + filename.rsplit("/backends_", 1)[1].split("/", 1)[0]
        elif filename == "~":
            if "socket" in name or "select" in name or "epoll" in name:
                package = "(socket/epoll syscalls)"
            elif "orjson" in name:
                package = "orjson"
            else:
                package = "(other C builtins)"
        elif "/asyncio/" in filename:
            package = "asyncio (stdlib)"
        elif "bench/" in filename:
            package = "(benchmark harness)"
        else:
            package = "(other stdlib)"
        shares[package] = shares.get(package, 0.0) + value[2] / total
    return sorted(shares.items(), key=lambda kv: -kv[1])


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--client", default="ours_ids")
    parser.add_argument("--body", default="plain")
    parser.add_argument("--conc", type=int, default=1)
    parser.add_argument("--n", type=int, default=400)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--sort", default="tottime")
    parser.add_argument("--admin", type=int, default=0, help="profile admin calls over this many servers")
    parser.add_argument("--delay", type=float, default=0.05, help="seconds each emulated server takes per admin call")
    parser.add_argument("--render", action="store_true", help="time the pieces of the default render instead")
    parser.add_argument("--sync", action="store_true", help="with --admin: profile admin.weight_sync")
    args = parser.parse_args()
    c.pin(0)
    if args.render:
        render_pieces(args.n)
        return
    if args.admin:
        profile, calls = await profile_admin(args.admin, args.n, args.delay, sync=args.sync)
        what = "weight_sync" if args.sync else "pause → update → resume"
        report(profile, f"{what} over {args.admin} servers, per admin call", calls, args)
        return
    fx = Fixture()
    with c.ServerProcess() as server:
        port = "re_obj" if args.body == "re" and args.client.startswith("renderers") else args.body
        if args.client == "ours_stream":
            import bench_stream

            call, client = await bench_stream.async_client(args.client, server.url("plain"), bench_stream.Fixture())
            close = client.aclose
        else:
            call, close = await make_factory(args.client, server.url(port), args.body, fx)()
        await run_calls(call, 2 * args.conc, args.conc)
        profile = cProfile.Profile(time.process_time)  # CPU time: the machines are shared
        profile.enable()
        await run_calls(call, args.n, args.conc)
        profile.disable()
        await close()
    report(profile, f"{args.client} {args.body} c={args.conc}", args.n, args)


def render_pieces(n: int) -> None:
    """CPU µs per call of each piece of the default render over the 64 varying-last-message chats."""
    import time

    from backends_core.multiturn.prefix_cache import PrefixRenderCache
    from backends_core.multiturn.rendering import encode, render_text

    tok = c.tokenizer()
    chats = c.chat_variants(tok)
    cache = PrefixRenderCache()
    cache.render(tok, chats[0])
    texts = [render_text(tok, m) for m in chats]
    [state] = cache._tokenizers.values()  # one tokenizer, one prefix
    [entry] = state.entries.values()
    pieces = {
        "prefix cache render (template + tail ids)": lambda m, t: cache.render(tok, m),
        "chat template (render_text, whole chat)": lambda m, t: render_text(tok, m),
        "tokenize the whole text": lambda m, t: encode(tok, t),
        "tokenize after the cached prefix": lambda m, t: encode(tok, t[len(entry.text) :]),
        "chat template over the last message alone": lambda m, t: render_text(tok, m[-1:]),
    }
    print(f"prefix: {len(entry.text)} chars, {len(entry.ids)} ids; texts {len(texts[0])} chars")
    for label, piece in pieces.items():
        t0 = time.process_time()
        for i in range(n):
            piece(chats[i % len(chats)], texts[i % len(texts)])
        print(f"  {label:<46} {(time.process_time() - t0) / n * 1e6:7.0f} µs")


async def profile_admin(servers: int, rounds: int, delay: float, *, sync: bool = False) -> tuple[cProfile.Profile, int]:
    """``rounds`` of pause → update → resume (``sync``: of ``weight_sync``) over ``servers`` emulated servers under
    cProfile; returns the profile and the number of admin calls the servers answered."""
    from backends_core import Client, ClientConfig

    with c.ServerProcess("--admin", str(servers), "--admin-delay", str(delay)) as fleet:
        urls = [fleet.url(f"admin{i}") for i in range(servers)]
        async with Client(ClientConfig(backend="vllm", base_url=urls, model=c.MODEL)) as client:
            await client.admin.health()  # connections up
            profile = cProfile.Profile(time.process_time)  # CPU time: the machines are shared
            before = c.admin_calls(urls[0])
            for r in range(rounds):
                profile.enable()
                if sync:
                    await client.admin.weight_sync(path="/ckpt/step", version=f"w{r}", mode="wait")
                else:
                    await client.admin.pause(mode="wait")
                    await client.admin.update_weights("/ckpt/step", version=f"v{r}")
                    await client.admin.resume()
                profile.disable()
            calls = c.admin_calls(urls[0]) - before
    return profile, calls


def report(profile: cProfile.Profile, what: str, calls: int, args: argparse.Namespace) -> None:
    out = io.StringIO()
    stats = pstats.Stats(profile, stream=out)
    total = sum(v[2] for v in stats.stats.values())  # type: ignore[attr-defined]
    print(f"{what}: {total / calls * 1e6:.0f} µs/call of profiled own time")
    print("own time by package (share of the client's profiled CPU):")
    for package, share in by_package(stats, total):
        print(f"  {package:<28} {share * 100:5.1f} %")
    stats.sort_stats(args.sort).print_stats(args.top)
    print("\n".join(line for line in out.getvalue().splitlines() if line.strip())[:12000])


if __name__ == "__main__":
    asyncio.run(main())
