"""Shared pieces of the router probes: raw HTTP, per-replica counters, and the observation log for ROUTERS.md.

Observations are written as JSON lines to ``<basetemp>/router-probe.jsonl`` (and echoed to stderr) so that the next
implementer can read the exact answers the routers gave."""

from __future__ import annotations

import json
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from backends_testkit.live import probe_client

TIMEOUT = httpx.Timeout(120.0, connect=10.0)
SETTLE_S = 60.0
"""Seconds a replica's counter may take to show a finished request (it is updated after the answer is sent)."""


def http() -> httpx.Client:
    return probe_client(TIMEOUT)


def body_of(response: httpx.Response) -> Any:
    try:
        return response.json()
    except ValueError:
        return response.text


class Observations:
    def __init__(self, path: Path, test: str) -> None:
        self.path = path
        self.test = test

    def __call__(self, what: str, **facts: Any) -> None:
        line = json.dumps({"test": self.test, "what": what, **facts}, default=str)
        with self.path.open("a", encoding="utf-8") as handle:
            handle.write(line + "\n")
        sys.stderr.write(f"\n[router-probe] {line[:2000]}\n")


_SUCCESS = re.compile(r"^vllm:request_success_total\{[^}]*\}\s+([0-9.eE+-]+)$", re.MULTILINE)


def vllm_finished(client: httpx.Client, url: str) -> int:
    """Requests a vLLM replica finished, from its own ``/metrics`` (``vllm:request_success_total`` over every
    finish reason)."""
    text = client.get(url + "/metrics").text
    return int(sum(float(value) for value in _SUCCESS.findall(text)))


def sglang_prefilled(client: httpx.Client, url: str) -> int:
    """Uncached prompt tokens an SGLang replica prefilled so far (``/v1/loads``
    ``total_prefill_uncached_tokens``): a fresh prompt raises it on the replica that ran it."""
    loads = client.get(url + "/v1/loads").json()["loads"]
    return int(sum(load["total_prefill_uncached_tokens"] for load in loads))


def which_replica(
    client: httpx.Client, urls: list[str], counter: Callable[[httpx.Client, str], int], send: Callable[[], None]
) -> int:
    """Index of the one replica whose counter moved while ``send()`` ran (waits up to SETTLE_S for it)."""
    before = [counter(client, url) for url in urls]
    send()
    deadline = time.monotonic() + SETTLE_S
    while True:
        moved = [i for i, url in enumerate(urls) if counter(client, url) != before[i]]
        if moved:
            assert len(moved) == 1, f"more than one replica's counter moved for one request: {moved}"
            return moved[0]
        assert time.monotonic() < deadline, f"no replica's counter moved within {SETTLE_S:.0f}s"
        time.sleep(0.05)
