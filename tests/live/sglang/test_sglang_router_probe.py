"""sglang-router 0.3.2 (SGLang Model Gateway) in front of two real SGLang replicas: the facts the router-front client
mode relies on, pinned against the real router (vllm-router: ``../test_routers_probe.py``). Findings are
summarised in ``../ROUTERS.md``."""

from __future__ import annotations

import time

import pytest
from router_probe_checks import body_of, http, sglang_prefilled, which_replica

pytestmark = pytest.mark.live

PROMPT = [1878, 426, 198, 54, 441, 355, 220, 17, 10, 17, 30, 1879, 198, 1878, 515, 198]
GREEDY = {"max_new_tokens": 4, "temperature": 0.0}
REMOVE_S = 60.0
"""Seconds a ``DELETE /workers/{id}`` (202, applied in the background) may take to show in ``GET /workers``."""


@pytest.fixture
def replicas(sglang_dense_url: str, sglang_dense_url_2: str) -> list[str]:
    return [sglang_dense_url, sglang_dense_url_2]


def _workers(client, router_url: str) -> list[dict]:
    answer = client.get(router_url + "/workers")
    assert answer.status_code == 200, answer.text
    return answer.json()["workers"]


def _until(what: str, check, timeout: float = REMOVE_S):
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"{what}: not within {timeout:.0f}s"
        time.sleep(0.1)


def test_worker_api(start_router, replicas, observe) -> None:
    router = start_router("sglang", replicas, policy="round_robin")
    observe("startup", healthy_after_s=round(router.healthy_after or -1, 2))
    with http() as client:
        listed = client.get(router.url + "/workers")
        observe("GET /workers", status=listed.status_code, body=body_of(listed))
        workers = listed.json()["workers"]
        assert sorted(w["url"].rstrip("/") for w in workers) == sorted(replicas)
        assert all(w["is_healthy"] is True and isinstance(w["id"], str) for w in workers)
        second = next(w for w in workers if w["url"].rstrip("/") == replicas[1])

        removed = client.delete(router.url + f"/workers/{second['id']}")
        observe("DELETE /workers/{id}", status=removed.status_code, body=body_of(removed))
        assert removed.status_code == 202
        started = time.monotonic()
        _until("worker removed", lambda: [w["url"].rstrip("/") for w in _workers(client, router.url)] == [replicas[0]])
        observe("removal visible in GET /workers", after_s=round(time.monotonic() - started, 2))
        for _ in range(4):  # everything now lands on the remaining replica
            answer = client.post(router.url + "/generate", json={"input_ids": PROMPT, "sampling_params": GREEDY})
            assert answer.status_code == 200, answer.text

        added = client.post(router.url + "/workers", json={"url": replicas[1]})
        observe("POST /workers {url}", status=added.status_code, body=body_of(added), headers=dict(added.headers))
        assert added.status_code == 202
        started = time.monotonic()
        _until(
            "worker re-added and healthy",
            lambda: (
                sorted(w["url"].rstrip("/") for w in _workers(client, router.url) if w["is_healthy"])
                == sorted(replicas)
            ),
        )
        observe("addition healthy in GET /workers", after_s=round(time.monotonic() - started, 2))
        unknown = client.delete(router.url + "/workers/00000000-0000-0000-0000-000000000000")
        observe("DELETE /workers/{unknown id}", status=unknown.status_code, body=body_of(unknown))
        by_url = client.get(router.url + "/list_workers")
        observe("GET /list_workers", status=by_url.status_code, body=body_of(by_url))


def test_token_in_generate_passes_through(start_router, replicas, observe) -> None:
    router = start_router("sglang", replicas, policy="round_robin")
    body = {"input_ids": PROMPT, "sampling_params": GREEDY, "return_logprob": True}
    with http() as client:
        direct = client.post(replicas[0] + "/generate", json=body).json()
        for _ in range(2):
            routed = client.post(router.url + "/generate", json=body)
            assert routed.status_code == 200, routed.text
            answer = routed.json()
            assert answer["output_ids"] == direct["output_ids"]
            assert len(answer["meta_info"]["output_token_logprobs"]) == GREEDY["max_new_tokens"]
        observe("POST /generate via router", status=routed.status_code, body=answer)
        info = client.get(router.url + "/get_server_info")
        observe("GET /get_server_info via router", status=info.status_code, body=body_of(info))
        assert info.status_code == 200


@pytest.mark.parametrize(
    ("policy", "header"),
    [("manual", "X-SMG-Routing-Key"), ("manual", "X-Session-ID"), ("round_robin", "X-SMG-Routing-Key")],
)
def test_routing_key_pins_a_replica(start_router, replicas, observe, policy, header) -> None:
    router = start_router("sglang", replicas, policy=policy)
    landed: dict[str, list[int]] = {}
    fresh = iter(range(1000, 2000))  # a new first token per request: never a prefix-cache hit
    with http() as client:
        for key in ("traj-1", "traj-2", "traj-3", "traj-4", "traj-5", "traj-6"):
            landed[key] = []
            for _ in range(3):

                def send(key: str = key) -> None:
                    answer = client.post(
                        router.url + "/generate",
                        json={"input_ids": [next(fresh), *PROMPT], "sampling_params": GREEDY},
                        headers={header: key},
                    )
                    assert answer.status_code == 200, answer.text

                landed[key].append(which_replica(client, replicas, sglang_prefilled, send))
    observe("routing header -> replica per request", policy=policy, header=header, landed=landed)
    pinned = all(len(set(rs)) == 1 for rs in landed.values())
    if (policy, header) == ("manual", "X-SMG-Routing-Key"):
        assert pinned, landed
    elif policy == "round_robin":
        assert not pinned, landed


def test_admin_routes(start_router, replicas, observe) -> None:
    """Which admin routes the router forwards, fans out, or answers 404."""
    router = start_router("sglang", replicas, policy="round_robin")
    results = {}
    with http() as client:
        for method, path in [
            ("POST", "/flush_cache"),
            ("GET", "/health"),
            ("GET", "/health_generate"),
            ("GET", "/readiness"),
            ("GET", "/liveness"),
            ("GET", "/get_model_info"),
            ("GET", "/model_info"),
            ("GET", "/server_info"),
            ("GET", "/get_loads"),
            ("GET", "/v1/loads"),
            ("GET", "/v1/models"),
            ("GET", "/metrics"),
            ("POST", "/pause_generation"),
            ("POST", "/continue_generation"),
            ("POST", "/abort_request"),
            ("POST", "/update_weights_from_disk"),
            ("POST", "/update_weight_version"),
            ("GET", "/get_weight_version"),
        ]:
            answer = client.request(method, router.url + path, json={} if method == "POST" else None)
            body = body_of(answer)
            results[f"{method} {path}"] = [answer.status_code, body[:300] if isinstance(body, str) else body]
        for url in replicas:  # leave the replicas as found, whatever got through
            client.post(url + "/continue_generation", json={})
    observe("admin routes via router", results=results)
    status, flushed = results["POST /flush_cache"]
    assert status == 200 and flushed["workers_flushed"] == 2, flushed


def test_routing_keys_after_membership_change(start_router, replicas, observe) -> None:
    """manual policy: where pinned keys land after their replica is removed, and after it is added back."""
    router = start_router("sglang", replicas, policy="manual")
    keys = [f"traj-{i}" for i in range(8)]
    fresh = iter(range(1000, 2000))
    with http() as client:

        def key_map() -> list[int]:
            landed = []
            for key in keys:

                def send(key: str = key) -> None:
                    answer = client.post(
                        router.url + "/generate",
                        json={"input_ids": [next(fresh), *PROMPT], "sampling_params": GREEDY},
                        headers={"X-SMG-Routing-Key": key},
                    )
                    assert answer.status_code == 200, answer.text

                landed.append(which_replica(client, replicas, sglang_prefilled, send))
            return landed

        before = key_map()
        second = next(w for w in _workers(client, router.url) if w["url"].rstrip("/") == replicas[1])
        assert client.delete(router.url + f"/workers/{second['id']}").status_code == 202
        _until("worker removed", lambda: [w["url"].rstrip("/") for w in _workers(client, router.url)] == [replicas[0]])
        removed = key_map()
        assert client.post(router.url + "/workers", json={"url": replicas[1]}).status_code == 202
        _until("worker back", lambda: sum(w["is_healthy"] for w in _workers(client, router.url)) == 2)
        readded = key_map()
    observe("X-SMG-Routing-Key map across remove/add", before=before, removed=removed, readded=readded)
    assert removed == [0] * len(keys)
    assert readded == before, "a key moved after its replica came back"
