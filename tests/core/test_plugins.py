"""Finding, loading and validating backends."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from backends_core import (
    BackendConflictError,
    BackendLoadError,
    BackendNotFoundError,
    BackendValidationError,
    SamplingParams,
    available_backends,
    hookimpl,
)
from backends_core.plugins import make_plugin_manager


class OnlyGenerate:
    @hookimpl
    async def post_generate(self, server, request):
        return {}

    @hookimpl
    def parse_response(self, raw):
        return []


def install_distribution(site: Path, dist: str, entry_points: dict[str, str], modules: dict[str, str]) -> None:
    """Write a real installed distribution (dist-info with entry_points.txt) into ``site``."""
    info = site / f"{dist.replace('-', '_')}-1.2.3.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.2.3\n")
    lines = "\n".join(f"{k} = {v}" for k, v in entry_points.items())
    (info / "entry_points.txt").write_text(f"[backends_core.backends]\n{lines}\n")
    for name, source in modules.items():
        (site / f"{name}.py").write_text(textwrap.dedent(source))


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in [m for m in sys.modules if m.startswith("throwaway_")]:
        del sys.modules[name]


GOOD_BACKEND = """
    from backends_core import hookimpl

    @hookimpl
    async def post_generate(server, request):
        return await server.request("POST", "/gen", json_body={"ids": list(request.prompt_ids)})

    @hookimpl
    def parse_response(raw, request):
        import numpy as np
        from backends_core import GenerateResult
        return [GenerateResult(prompt_ids=request.prompt_ids, completion_ids=tuple(raw["ids"]),
                               logprobs=np.asarray(raw["lps"], dtype=np.float32), finish_reason="length")]

    @hookimpl
    async def admin_health(server):
        return True
"""


def test_a_third_party_distribution_is_listed_without_importing_it(site: Path) -> None:
    install_distribution(site, "backends-acme", {"acme": "throwaway_acme"}, {"throwaway_acme": GOOD_BACKEND})
    listed = {b.name: b for b in available_backends()}
    assert listed["acme"].distribution == "backends-acme"
    assert listed["acme"].version == "1.2.3"
    assert "throwaway_acme" not in sys.modules
    assert "reference" in listed  # the core's own backend


async def test_a_third_party_backend_runs_end_to_end_through_its_entry_point(site: Path) -> None:
    import httpx

    from backends_core import Client, ClientConfig

    install_distribution(site, "backends-acme", {"acme": "throwaway_acme"}, {"throwaway_acme": GOOD_BACKEND})
    transport = httpx.MockTransport(lambda r: httpx.Response(200, json={"ids": [7, 8], "lps": [-0.5, -1.5]}))
    async with Client(ClientConfig(backend="acme", base_url="http://acme"), transport=transport) as client:
        result = await client.generate(prompt_ids=[1, 2, 3], sampling=SamplingParams(max_tokens=16))
        assert result.completion_ids == (7, 8)
        assert result.logprobs.tolist() == [-0.5, -1.5]
        assert client.capabilities == {"admin_health"}
        assert await client.admin.health() == [True]


def test_unknown_backend_lists_installed_suggests_and_hints(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(BackendNotFoundError) as info:
        make_plugin_manager("referense")
    message = str(info.value)
    assert "installed: " in message and "reference" in message.split("installed: ")[1]
    assert "did you mean 'reference'?" in message
    assert 'pip install "backends[vllm,dynamo,sglang]"' in message
    import backends_core.plugins as plugins

    monkeypatch.setattr(plugins, "_entry_points", list)  # a machine with no backend installed
    with pytest.raises(
        BackendNotFoundError, match=r'installed: none; install it with: pip install "backends\[sglang\]"'
    ):
        make_plugin_manager("sglang")


def test_import_failure_of_the_selected_backend_is_a_load_error(site: Path) -> None:
    install_distribution(
        site,
        "backends-broken",
        {"broken": "throwaway_broken"},
        {"throwaway_broken": "raise RuntimeError('needs CUDA')\n"},
    )
    with pytest.raises(BackendLoadError, match="needs CUDA") as info:
        make_plugin_manager("broken")
    assert isinstance(info.value.__cause__, RuntimeError)
    make_plugin_manager("reference")  # an unrelated broken backend breaks nobody else


def test_two_distributions_claiming_one_name_conflict(site: Path) -> None:
    install_distribution(site, "backends-one", {"dup": "throwaway_one"}, {"throwaway_one": GOOD_BACKEND})
    install_distribution(site, "backends-two", {"dup": "throwaway_two"}, {"throwaway_two": GOOD_BACKEND})
    with pytest.raises(BackendConflictError, match="backends-one, backends-two"):
        make_plugin_manager("dup")
    with pytest.raises(BackendConflictError):
        available_backends()


def test_missing_required_hooks_are_named() -> None:
    class NoParse:
        @hookimpl
        async def post_generate(self, server):
            return {}

    with pytest.raises(BackendValidationError, match="parse_response") as info:
        make_plugin_manager("x", plugin=NoParse())
    assert info.value.missing == ["parse_response"]


def test_unknown_hook_names_and_bad_arguments_are_rejected() -> None:
    class Typo:
        @hookimpl
        async def post_generate(self, server):
            return {}

        @hookimpl
        def parse_response(self, raw):
            return []

        @hookimpl
        async def admin_pasue(self, server):
            return True

    with pytest.raises(BackendValidationError, match="admin_pasue"):
        make_plugin_manager("x", plugin=Typo())

    class BadArg:
        @hookimpl
        async def post_generate(self, server, payload):
            return {}

        @hookimpl
        def parse_response(self, raw):
            return []

    with pytest.raises(BackendValidationError, match="payload"):
        make_plugin_manager("x", plugin=BadArg())


def test_in_process_backend_registers_next_to_core_defaults() -> None:
    pm = make_plugin_manager("inproc", plugin=OnlyGenerate())
    assert pm.get_plugin("inproc") is not None
    assert pm.get_plugin("backends_core.defaults") is not None


def ordered(name: str, answer: object, calls: list[str], **opts: bool) -> object:
    """A plugin whose ``parse_response`` records its call and answers ``answer`` (``None`` hands the call on)."""

    def parse_response(self: object, raw: object) -> object:
        calls.append(name)
        return answer

    return type(f"Plugin_{name}", (), {"parse_response": hookimpl(**opts)(parse_response)})()


@pytest.mark.parametrize(
    "plugins",
    [
        [("a", "A", {}), ("b", "B", {})],  # the last registered runs first
        [("a", "A", {"tryfirst": True}), ("b", "B", {})],
        [("a", None, {}), ("b", None, {})],  # nobody answers: None
        [("a", "A", {}), ("b", None, {}), ("c", None, {"trylast": True})],  # None falls through to the next
    ],
)
def test_a_direct_hook_call_runs_what_pluggy_runs_in_its_order(plugins: list[tuple[str, object, dict]]) -> None:
    from backends_core.plugins import HookCall

    outcomes = []
    for direct in (False, True):
        calls: list[str] = []
        pm = make_plugin_manager("x", plugin=OnlyGenerate())
        pm.unregister(name="x")
        for name, answer, opts in plugins:
            pm.register(ordered(name, answer, calls, **opts), name=name)
        kwargs = {"raw": {}, "request": None, "server_url": "u", "config": None, "options": None}
        result = HookCall(pm, "parse_response")(**kwargs) if direct else pm.hook.parse_response(**kwargs)
        outcomes.append((result, calls))
    assert outcomes[0] == outcomes[1]


def test_a_direct_hook_call_sees_plugins_registered_later_and_leaves_wrappers_to_pluggy() -> None:
    from backends_core.plugins import HookCall

    pm = make_plugin_manager("x", plugin=OnlyGenerate())
    hook = HookCall(pm, "parse_response")
    kwargs = {"raw": {}, "request": None, "server_url": "u", "config": None, "options": None}

    def call() -> object:
        return hook(**kwargs)

    assert call() == []
    calls: list[str] = []
    pm.register(ordered("late", "late answer", calls), name="late")
    assert call() == "late answer" and calls == ["late"]

    class Wrapper:
        @hookimpl(wrapper=True)
        def parse_response(self, raw: object):  # type: ignore[no-untyped-def]
            inner = yield
            return ("wrapped", inner)

    pm.register(Wrapper(), name="wrapper")
    assert call() == ("wrapped", "late answer")
