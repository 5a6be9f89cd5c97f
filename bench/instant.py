"""The instant server of the benchmarks: a canned vLLM ``/inference/v1/generate`` in its own process.

    uv run python bench/instant.py [--hold] [--admin N] [--admin-delay 0.05] [--stream-step-ms 0]

Prints one JSON line ``{"plain": port, "re": port, "re_obj": port, ...}`` once listening, then serves until killed.
An ``asyncio.Protocol`` on uvloop (when installed) answering pre-encoded responses, so the server's own cost per
request stays far below the client's. Ports:

* ``plain``: 256 completion tokens with logprob entries, ``routed_experts: null``;
* ``re``: the same + ``routed_experts`` for a 1,024-token prompt (1,279 rows × 48 layers × top-8, uint8) as vLLM
  0.32 sends it (base64 of a ``.npy``), which is what our vLLM backend parses;
* ``re_obj``: the same routing as ``{"data": base64 raw, "shape", "start", "dtype"}``, the form renderers'
  splice parser recognises (it falls back to a full ``json.loads`` on the string form);
* every port's ``/inference/v1/generate`` with ``"stream": true`` in the body answers the same sample as Server-Sent
  Events the way vLLM 0.32 sends them (``_common.stream_events``: one ``data:`` event per token, the usage chunk,
  ``[DONE]``), each event one HTTP chunk (``transfer-encoding: chunked``, as uvicorn frames a streamed response)
  written on its own (one write per event, each in its own loop iteration; ``--stream-step-ms`` spaces them like
  an engine's steps);
* ``multiturn``: ``plain`` with ``usage.prompt_tokens``/``total_tokens`` set to the number of prompt ids sent (a
  multi-turn session's prompts grow turn after turn; the client checks the count): the ids are counted in the
  request bytes (no JSON parse) and each length's answer is built once;
* ``hold`` (``--hold``): answers ``plain`` but holds every generate request until ``POST /bench/release`` (on any
  port; later requests are answered at once until ``POST /bench/hold``): guaranteed in-flight requests;
* ``admin0``… (``--admin N``): N emulated servers answering vLLM's admin routes after ``--admin-delay`` seconds
  (and ``plain`` for generate).

Every port answers ``GET /v1/models`` (``max_model_len`` for the client's pre-flight check).
"""

from __future__ import annotations

import argparse
import asyncio
import json

import _common as c


def chunked(events: list[bytes]) -> tuple[bytes, list[bytes]]:
    """The head of a streamed 200 answer and its HTTP chunks (one per event, then the last, empty one)."""
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\ntransfer-encoding: chunked\r\n\r\n"
    pieces = [b"%x\r\n%s\r\n" % (len(e), e) for e in events]
    pieces[-1] += b"0\r\n\r\n"
    return head, pieces


def response(body: bytes, status: str = "200 OK") -> bytes:
    head = f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
    return head.encode("latin1") + body


class State:
    def __init__(self, admin_delay: float, stream: tuple[bytes, list[bytes]], step: float) -> None:
        self.stream, self.step = stream, step
        self.held: list[tuple[asyncio.Transport, bytes]] = []
        self.admin_delay = admin_delay
        self.versions: dict[int, str] = {}
        self.paused: dict[int, bool] = {}
        self.requests = 0
        self.admin_calls = 0  # admin requests answered, all emulated servers together
        self.holding = True
        self.grown: dict[int, bytes] = {}  # the multiturn port's answer per prompt length
        self.grow_parts: tuple[bytes, bytes] = (b"", b"")

    def grown_answer(self, body: bytes) -> bytes:
        """``plain`` with the usage of the prompt ``body`` sends (its ``token_ids`` counted, not parsed)."""
        at = body.find(b'{"token_ids":[')
        if at < 0:
            at = body.find(b',"token_ids":[')
        start = at + 14
        end = body.find(b"]", start)
        n = body.count(b",", start, end) + 1 if end > start else 0
        answer = self.grown.get(n)
        if answer is None:
            before, after = self.grow_parts
            usage = b'"prompt_tokens":%d,"total_tokens":%d,' % (n, n + c.COMPLETION_TOKENS)
            answer = self.grown[n] = response(before + usage + after)
        return answer


def admin_answer(state: State, port: int, method: str, path: str, body: bytes) -> bytes | None:
    route = path.split("?", 1)[0]
    if route == "/health":
        return response(b"")
    if route == "/pause":
        state.paused[port] = True
        return response(b'{"status":"paused"}')
    if route == "/resume":
        state.paused[port] = False
        return response(b'{"status":"resumed"}')
    if route == "/collective_rpc":
        return response(b'{"results":[null]}')
    if route == "/update_weight_version":
        state.versions[port] = json.loads(body)["new_version"]
        return response(b'{"success":true}')
    if route == "/reset_prefix_cache":
        return response(b'{"success":true}')
    if route == "/is_paused":
        return response(json.dumps({"is_paused": state.paused.get(port, False)}).encode())
    if route == "/is_sleeping":
        return response(b'{"is_sleeping":false}')
    if route == "/weight_info":
        return response(json.dumps({"weight_version": state.versions.get(port, "default")}).encode())
    if route == "/metrics":
        body = b"".join(b'vllm:num_requests_%s{model_name="tiny-qwen3"} 0.0\n' % k for k in (b"running", b"waiting"))
        return b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
    if route == "/load":
        return response(b'{"server_load":0}')
    return None


class Protocol(asyncio.Protocol):
    def __init__(self, state: State, port: int, kind: str, generate: bytes, models: bytes) -> None:
        self.state, self.port, self.kind = state, port, kind
        self.generate, self.models = generate, models
        self.buffer = bytearray()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while True:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            head = bytes(self.buffer[:end]).decode("latin1")
            length = 0
            for line in head.split("\r\n")[1:]:
                name, _, value = line.partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value)
            if len(self.buffer) < end + 4 + length:
                return
            body = bytes(self.buffer[end + 4 : end + 4 + length])
            del self.buffer[: end + 4 + length]
            method, path, _ = head.split(" ", 2)
            self.handle(method, path, body)

    def handle(self, method: str, path: str, body: bytes) -> None:
        assert self.transport is not None
        state = self.state
        if path.endswith("/inference/v1/generate"):
            state.requests += 1
            if b'"stream"' in body and json.loads(body).get("stream"):
                head, pieces = state.stream
                self.transport.write(head)
                self._stream(pieces, 0)
                return
            if self.kind == "multiturn":
                self.transport.write(state.grown_answer(body))
                return
            if self.kind == "hold" and state.holding:
                state.held.append((self.transport, self.generate))
            else:
                self.transport.write(self.generate)
            return
        if path.startswith("/v1/models"):
            if self.kind.startswith("admin"):
                state.admin_calls += 1
            self.transport.write(self.models)
            return
        if path == "/bench/hold":
            state.holding = True
            self.transport.write(response(b"{}"))
            return
        if path == "/bench/release":  # answer every held request, and the next ones at once until /bench/hold
            state.holding = False
            held, state.held = state.held, []
            for transport, answer in held:
                if not transport.is_closing():
                    transport.write(answer)
            self.transport.write(response(json.dumps({"released": len(held)}).encode()))
            return
        if path == "/bench/stats":
            self.transport.write(
                response(
                    json.dumps(
                        {"requests": state.requests, "held": len(state.held), "admin": state.admin_calls}
                    ).encode()
                )
            )
            return
        answer = admin_answer(state, self.port, method, path, body)
        state.admin_calls += 1
        if answer is None:
            answer = response(b'{"detail":"Not Found"}', "404 Not Found")
        if state.admin_delay > 0:
            asyncio.get_running_loop().call_later(state.admin_delay, self._write, answer)
        else:
            self.transport.write(answer)

    def _stream(self, pieces: list[bytes], at: int) -> None:
        """Write event ``at``, then schedule the next one (the next loop iteration, or ``--stream-step-ms`` later)."""
        if self.transport is None or self.transport.is_closing():
            return
        self.transport.write(pieces[at])
        if at + 1 < len(pieces):
            loop = asyncio.get_running_loop()
            if self.state.step > 0:
                loop.call_later(self.state.step, self._stream, pieces, at + 1)
            else:
                loop.call_soon(self._stream, pieces, at + 1)

    def _write(self, data: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hold", action="store_true")
    parser.add_argument("--admin", type=int, default=0)
    parser.add_argument("--admin-delay", type=float, default=0.0)
    parser.add_argument("--no-pin", action="store_true")
    parser.add_argument("--stream-step-ms", type=float, default=0.0, help="delay between streamed events")
    args = parser.parse_args()
    if not args.no_pin:
        c.pin(1)
    tok = c.tokenizer()
    completion = c.completion_ids(tok)
    plain = response(c.generate_body(completion))
    bodies = {
        "plain": plain,
        "re": response(c.generate_body(completion, routed="npy")),
        "re_obj": response(c.generate_body(completion, routed="object")),
    }
    bodies["multiturn"] = plain
    kinds = list(bodies)
    if args.hold:
        bodies["hold"] = plain
        kinds.append("hold")
    for i in range(args.admin):
        bodies[f"admin{i}"] = plain
        kinds.append(f"admin{i}")
    state = State(args.admin_delay, chunked(c.stream_events(completion)), args.stream_step_ms / 1000)
    canned = c.generate_body(completion)
    usage = b'"prompt_tokens":%d,"total_tokens":%d,' % (c.PROMPT_TOKENS, c.PROMPT_TOKENS + c.COMPLETION_TOKENS)
    before, _, after = canned.partition(usage)
    assert after, "the canned body's usage is not where the multiturn port expects it"
    state.grow_parts = (before, after)
    models = response(c.models_body())
    loop = asyncio.get_running_loop()
    ports: dict[str, int] = {}
    servers = []
    for kind in kinds:
        holder: dict[str, int] = {}

        def factory(kind: str = kind, holder: dict[str, int] = holder) -> Protocol:
            return Protocol(state, holder["port"], kind, bodies[kind], models)

        server = await loop.create_server(factory, "127.0.0.1", 0, backlog=4096)
        holder["port"] = ports[kind] = server.sockets[0].getsockname()[1]
        servers.append(server)
    print(json.dumps(ports), flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    try:
        import uvloop

        uvloop.run(main())
    except ImportError:
        asyncio.run(main())
