"""vllm-router 0.1.17 in front of two real vLLM replicas: the facts the router-front client mode relies on,
pinned against the real router. SGLang's router is probed in ``sglang/test_sglang_router_probe.py`` (its replicas
are fixtures of that directory). Findings are summarised in ``ROUTERS.md``."""

from __future__ import annotations

import json
from urllib.parse import quote

import pytest
from router_probe_checks import body_of, http, vllm_finished, which_replica

pytestmark = pytest.mark.live

PROMPT = [1878, 426, 198, 54, 441, 355, 220, 17, 10, 17, 30, 1879, 198, 1878, 515, 198]
GREEDY = {"max_tokens": 4, "temperature": 0.0}


@pytest.fixture
def replicas(vllm_dense_url: str, vllm_dense_url_2: str) -> list[str]:
    return [vllm_dense_url, vllm_dense_url_2]


def test_worker_lists(start_router, replicas, observe) -> None:
    router = start_router("vllm", replicas, policy="round_robin")
    observe("startup", healthy_after_s=round(router.healthy_after or -1, 2))
    with http() as client:
        listed = client.get(router.url + "/list_workers")
        observe("GET /list_workers", status=listed.status_code, body=body_of(listed))
        assert listed.status_code == 200
        assert sorted(u.rstrip("/") for u in listed.json()["urls"]) == sorted(replicas)

        workers = client.get(router.url + "/workers")
        observe("GET /workers", status=workers.status_code, body=body_of(workers))
        assert workers.status_code == 200
        body = workers.json()
        items = body["workers"] if isinstance(body, dict) else body
        assert sorted(w["url"].rstrip("/") for w in items) == sorted(replicas)
        assert all(w["is_healthy"] is True for w in items)

        loads = client.get(router.url + "/get_loads")
        observe("GET /get_loads", status=loads.status_code, body=body_of(loads))


def test_token_in_generate_passes_through(start_router, replicas, observe) -> None:
    router = start_router("vllm", replicas, policy="round_robin")
    body = {"token_ids": PROMPT, "sampling_params": {**GREEDY, "logprobs": 1}}
    with http() as client:
        direct = client.post(replicas[0] + "/inference/v1/generate", json=body).json()
        for _ in range(2):  # round robin: both replicas answer once
            routed = client.post(router.url + "/inference/v1/generate", json=body)
            assert routed.status_code == 200, routed.text
            answer = routed.json()
            assert answer["choices"][0]["token_ids"] == direct["choices"][0]["token_ids"]
            assert answer["choices"][0]["logprobs"] is not None
        observe("POST /inference/v1/generate via router", status=routed.status_code, body=answer)
        models = client.get(router.url + "/v1/models")
        observe("GET /v1/models via router", status=models.status_code, body=body_of(models))
        assert models.status_code == 200


@pytest.mark.parametrize("policy", ["consistent_hash", "round_robin"])
def test_session_header_pins_a_replica(start_router, replicas, observe, policy) -> None:
    router = start_router("vllm", replicas, policy=policy)
    landed: dict[str, list[int]] = {}
    with http() as client:
        for key in ("traj-1", "traj-2", "traj-3", "traj-4", "traj-5", "traj-6"):
            landed[key] = []
            for turn in range(3):

                def send(key: str = key, turn: int = turn) -> None:
                    answer = client.post(
                        router.url + "/inference/v1/generate",
                        json={"token_ids": [*PROMPT, 100 + turn], "sampling_params": GREEDY},
                        headers={"x-session-id": key},
                    )
                    assert answer.status_code == 200, answer.text

                landed[key].append(which_replica(client, replicas, vllm_finished, send))
    observe("x-session-id -> replica per request", policy=policy, landed=landed)
    if policy == "consistent_hash":
        assert all(len(set(replicas_of_key)) == 1 for replicas_of_key in landed.values()), landed
    else:
        assert any(len(set(replicas_of_key)) > 1 for replicas_of_key in landed.values()), landed


def test_admin_routes(start_router, replicas, observe) -> None:
    """Which admin routes go to one replica (chosen like generation), which fan out, which 404."""
    router = start_router("vllm", replicas, policy="round_robin")
    with http() as client:
        try:
            paused = client.post(router.url + "/pause", params={"mode": "keep"})
            states = [client.get(url + "/is_paused").json()["is_paused"] for url in replicas]
            observe("POST /pause?mode=keep via router", status=paused.status_code, body=body_of(paused), states=states)
            assert paused.status_code == 200
            assert sorted(states) == [False, True], "a pause through the router reaches exactly one replica"
        finally:
            for url in replicas:
                client.post(url + "/resume").raise_for_status()
        results = {}
        for method, path, params in [
            ("GET", "/is_paused", None),
            ("POST", "/resume", None),
            ("POST", "/reset_prefix_cache", None),
            ("POST", "/flush_cache", None),
            ("GET", "/weight_info", None),
            ("GET", "/health", None),
            ("GET", "/metrics", None),
            ("GET", "/get_server_info", None),
            ("GET", "/server_info", None),
            ("GET", "/is_sleeping", None),
            ("GET", "/get_model_info", None),
            ("GET", "/no_such_route", None),
        ]:
            answer = client.request(method, router.url + path, params=params)
            body = body_of(answer)
            text = body if isinstance(body, str) else json.dumps(body)
            results[f"{method} {path}"] = [answer.status_code, body if len(text) <= 600 else text[:300] + "..."]
        observe("admin routes via router", results=results)
        for url in replicas:  # leave the replicas as found
            client.post(url + "/resume").raise_for_status()
        assert results["POST /flush_cache"][0] == 500  # fanned out under SGLang's route name: vLLM has none


def _listed(client, router_url: str) -> list[str]:
    return sorted(u.rstrip("/") for u in client.get(router_url + "/list_workers").json()["urls"])


def test_worker_management(start_router, replicas, observe) -> None:
    """Adding and removing a replica at run time: ``/add_worker?url=``, ``/remove_worker?url=``, ``POST /workers``
    (all applied before the answer), and what ``DELETE /workers/{url}`` and ``/finish_session`` do."""
    router = start_router("vllm", replicas[:1], policy="consistent_hash")
    results = {}
    with http() as client:

        def call(method: str, path: str, **kwargs) -> tuple[int, object]:
            answer = client.request(method, router.url + path, **kwargs)
            results[f"{len(results)} {method} {path}"] = [answer.status_code, body_of(answer)]
            return answer.status_code, body_of(answer)

        assert call("POST", "/add_worker", params={"url": replicas[1]}) == (
            200,
            f"Successfully added worker: {replicas[1]}",
        )
        assert _listed(client, router.url) == sorted(replicas)
        assert call("POST", "/remove_worker", params={"url": replicas[1]})[0] == 200
        assert _listed(client, router.url) == [replicas[0]]
        assert call("POST", "/workers", json={"url": replicas[1]}) == (
            200,
            {"success": True, "message": f"Successfully added worker: {replicas[1]}"},
        )
        assert _listed(client, router.url) == sorted(replicas)
        assert call("DELETE", "/workers/" + quote(replicas[1], safe="")) == (
            200,
            {"success": True, "message": f"Worker {replicas[1]} removed successfully"},
        )
        assert _listed(client, router.url) == [replicas[0]]
        assert call("POST", "/finish_session", params={"session_id": "traj-1"}) == (
            200,
            {"status": "ok", "session_id": "traj-1"},
        )
        # an unknown path is proxied to a replica: vLLM's (FastAPI's) own 404 comes back
        assert call("GET", "/no_such_route") == (404, {"detail": "Not Found"})
    observe("worker management", results=results)


LONG_PROMPT = list(range(40, 360))  # 320 tokens: two or more 128-token cache blocks of vLLM CPU


def _cached_tokens(client, url: str) -> int:
    answer = client.post(
        url + "/inference/v1/generate", json={"token_ids": LONG_PROMPT, "sampling_params": {"max_tokens": 1}}
    )
    assert answer.status_code == 200, answer.text
    return int((answer.json()["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def test_reset_prefix_cache_reaches_one_replica(start_router, replicas, observe) -> None:
    router = start_router("vllm", replicas, policy="round_robin")
    with http() as client:
        for url in replicas:  # warm both prefix caches
            _cached_tokens(client, url)
        warm = [_cached_tokens(client, url) for url in replicas]
        assert all(n > 0 for n in warm), warm
        reset = client.post(router.url + "/reset_prefix_cache")
        after = [_cached_tokens(client, url) for url in replicas]
    observe(
        "POST /reset_prefix_cache via router", status=reset.status_code, body=body_of(reset), warm=warm, after=after
    )
    assert reset.status_code == 200
    assert sorted(n > 0 for n in after) == [False, True], after


def _session_map(client, router_url: str, replicas: list[str], keys: list[str]) -> list[int]:
    landed = []
    for turn, key in enumerate(keys):

        def send(key: str = key, turn: int = turn) -> None:
            answer = client.post(
                router_url + "/inference/v1/generate",
                json={"token_ids": [*PROMPT, 200 + turn], "sampling_params": GREEDY},
                headers={"x-session-id": key},
            )
            assert answer.status_code == 200, answer.text

        landed.append(which_replica(client, replicas, vllm_finished, send))
    return landed


def test_session_keys_after_membership_change(start_router, replicas, observe) -> None:
    """consistent_hash: where keys land after a replica is removed, and after it is added back."""
    router = start_router("vllm", replicas, policy="consistent_hash")
    keys = [f"traj-{i}" for i in range(8)]
    with http() as client:
        before = _session_map(client, router.url, replicas, keys)
        assert client.post(router.url + "/remove_worker", params={"url": replicas[1]}).status_code == 200
        removed = _session_map(client, router.url, replicas, keys)
        assert client.post(router.url + "/add_worker", params={"url": replicas[1]}).status_code == 200
        readded = _session_map(client, router.url, replicas, keys)
    observe("x-session-id map across remove/add", before=before, removed=removed, readded=readded)
    assert removed == [0] * len(keys)
    assert readded == before, "a key moved after its replica came back"
