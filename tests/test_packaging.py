"""Dependency extras per process, checked with real installs.

A fresh venv gets `pip install '<copy of the repo>[worker]'` (a real resolve, from
PyPI and PIP_FIND_LINKS, like the worker image's build): the launcher runs and
neither kopf nor the Kubernetes client is installed. A second fresh venv gets
README's quick start, `pip install -e .`: `tensorfleet plan` and `render` work on
the base alone. In both, a command whose extra is missing fails with one line
naming the extra. The installs take a few seconds with a warm pip cache.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import dockerfile
import pytest

from tensorfleet import extras
from tensorfleet.cli import main as tensorfleet_main
from tensorfleet.worker.cli import main as worker_main
from tensorfleet.worker.errors import EXIT_NOT_FOUND

ROOT = Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
OPTIONAL = PROJECT["optional-dependencies"]
EXAMPLE = ROOT / "examples" / "llama-3.1-70b-h100.yaml"   # README's quick start
MODEL = "meta-llama/Llama-3.1-8B-Instruct"                  # TF_MODEL alone is a valid launcher env
# Distribution names of the modules extras.MODULES lists (the rest are spelled alike).
DISTRIBUTION = {"prometheus_client": "prometheus-client", "pynvml": "nvidia-ml-py"}
# What the operator alone needs; none of it belongs in the worker image.
OPERATOR_ONLY = {"kopf", "kubernetes"}


def _name(requirement: str) -> str:
    match = re.match(r"[A-Za-z0-9._-]+", requirement.strip())
    assert match, requirement
    return re.sub(r"[-_.]+", "-", match.group(0)).lower()


def _requirements(*names: str) -> set[str]:
    """Distribution names the base plus the extras NAMES (self-references expanded) require."""
    wanted = dockerfile.expand_extras(set(names), OPTIONAL)
    out = {_name(r) for r in PROJECT["dependencies"]}
    out |= {_name(r) for extra in wanted for r in OPTIONAL.get(extra, []) if not r.startswith("tensorfleet[")}
    return out


# ---- pyproject and the guard agree (no install) -----------------------------------------------

def test_every_extra_the_commands_check_lists_their_modules() -> None:
    for extra, modules in extras.MODULES.items():
        assert extra in OPTIONAL, f"extras.MODULES names {extra!r}, which pyproject.toml does not define"
        for module in modules:
            assert DISTRIBUTION.get(module, module) in _requirements(extra), f"{module} is not in the {extra} extra"


def test_base_is_small_and_the_worker_extra_pulls_in_no_operator() -> None:
    assert {_name(r) for r in PROJECT["dependencies"]} == {"pydantic", "pyyaml"}
    assert not OPERATOR_ONLY & _requirements("worker")
    assert {"nvidia-ml-py", "prometheus-client"} <= _requirements("worker")
    # The worker image installs only what the worker extra brings.
    worker_image = dockerfile.instructions(ROOT / "worker-image" / "Dockerfile")
    runs = " ".join(rest for word, rest in worker_image if word == "RUN")
    assert not OPERATOR_ONLY & _requirements(*dockerfile.installed_extras(runs, OPTIONAL))


def test_dev_installs_every_process_and_control_plane_the_three_it_runs() -> None:
    assert {"operator", "router", "sim", "worker"} <= dockerfile.expand_extras({"dev"}, OPTIONAL)
    assert {"operator", "router", "sim", "fast"} <= dockerfile.expand_extras({"control-plane"}, OPTIONAL)


# ---- the guard, in this process (modules hidden) ----------------------------------------------

def _hide(monkeypatch: pytest.MonkeyPatch, *modules: str) -> None:
    # A None entry in sys.modules makes the module unimportable, as if not installed.
    for module in modules:
        monkeypatch.setitem(sys.modules, module, None)


def test_tensorfleet_run_without_the_operator_extra_says_which_to_install(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    _hide(monkeypatch, "kopf", "kubernetes")
    assert tensorfleet_main(["run", "--no-leader-election"]) == 1
    err = capsys.readouterr().err
    assert err == ("error: tensorfleet run needs the operator extra (kopf, kubernetes not installed): "
                   "pip install 'tensorfleet[operator]'\n")


@pytest.mark.parametrize(("argv", "extra"), [
    (["router", "--backend", "http://127.0.0.1:9"], "router"),
    (["sim", "--served-model-name", "m"], "sim"),
])
def test_router_and_sim_without_their_extra_say_which_to_install(
        argv: list[str], extra: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    _hide(monkeypatch, "aiohttp")
    assert tensorfleet_main(argv) == 1
    err = capsys.readouterr().err
    assert err == (f"error: tensorfleet {argv[0]} needs the {extra} extra (aiohttp not installed): "
                   f"pip install 'tensorfleet[{extra}]'\n")


def test_worker_without_its_extra_says_which_to_install_but_still_prints_its_plan(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    _hide(monkeypatch, "prometheus_client")
    for name in [k for k in os.environ if k.startswith("TF_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("TF_MODEL", MODEL)
    line = ("error: tensorfleet-worker{} needs the worker extra (prometheus_client not installed): "
            "pip install 'tensorfleet[worker]'\n")
    assert worker_main(["metrics"]) == EXIT_NOT_FOUND
    assert capsys.readouterr().err == line.format(" metrics")
    assert worker_main(["--state-file", ""]) == EXIT_NOT_FOUND
    assert capsys.readouterr().err == line.format("")
    assert worker_main(["--print-command"]) == 0
    assert json.loads(capsys.readouterr().out)


# ---- real installs into fresh venvs -----------------------------------------------------------

def _env() -> dict[str, str]:
    drop = {"PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "VIRTUAL_ENV"}
    return {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("TF_")}


def _source_copy(dest: Path) -> Path:
    """What the Dockerfiles copy (pyproject.toml, README.md, operator/): pip builds in the tree it is given."""
    dest.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, dest / name)
    shutil.copytree(ROOT / "operator", dest / "operator",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build"))
    return dest


def _venv(where: Path, *install: str) -> Path:
    subprocess.run([sys.executable, "-m", "venv", str(where)], check=True, capture_output=True, timeout=300)
    pip = [str(where / "bin" / "python"), "-m", "pip", "install", "--disable-pip-version-check", "--no-input"]
    done = subprocess.run([*pip, *install], check=False, capture_output=True, text=True, env=_env(), cwd=where,
                          timeout=900)
    assert done.returncode == 0, \
        f"pip install {' '.join(install)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return where / "bin"


@pytest.fixture(scope="module")
def installs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """bin/ of two fresh venvs: `worker` (`pip install 'SRC[worker]'`) and `base` (`pip install -e SRC`)."""
    tmp = tmp_path_factory.mktemp("packaging")
    return {
        "worker": _venv(tmp / "worker-venv", f"{_source_copy(tmp / 'worker-src')}[worker]"),
        "base": _venv(tmp / "base-venv", "-e", str(_source_copy(tmp / "base-src"))),
    }


def _run(bin_dir: Path, *argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(bin_dir / argv[0]), *argv[1:]], check=False, capture_output=True, text=True,
                          env={**_env(), **(env or {})}, cwd=bin_dir.parent, timeout=120)


def _distributions(bin_dir: Path) -> set[str]:
    code = ("import importlib.metadata as m, json; "
            "print(json.dumps(sorted({d.metadata['Name'] for d in m.distributions()})))")
    out = _run(bin_dir, "python", "-c", code)
    assert out.returncode == 0, out.stderr
    return {_name(name) for name in json.loads(out.stdout)}


def test_worker_extra_installs_the_launcher_without_kopf_or_kubernetes(installs: dict[str, Path]) -> None:
    bin_dir = installs["worker"]
    installed = _distributions(bin_dir)
    assert {"tensorfleet", "pydantic", "pyyaml", "prometheus-client", "nvidia-ml-py"} <= installed
    assert not installed & (OPERATOR_ONLY | {"aiohttp"}), sorted(installed)
    for package in OPERATOR_ONLY:
        shown = _run(bin_dir, "pip", "show", package)
        assert shown.returncode != 0, f"{package} is installed:\n{shown.stdout}"
    # The launcher starts, and plans a vLLM pod from its env.
    helped = _run(bin_dir, "tensorfleet-worker", "--help")
    assert helped.returncode == 0 and "health" in helped.stdout, helped.stderr
    planned = _run(bin_dir, "tensorfleet-worker", "--print-command", env={"TF_MODEL": MODEL})
    assert planned.returncode == 0, planned.stderr
    assert "vllm" in json.dumps(json.loads(planned.stdout))
    # pynvml imports; with no GPU here NVML does not start (3), on a GPU machine it reports (0 or 1).
    health = _run(bin_dir, "tensorfleet-worker", "health", "--state-file", "")
    assert health.returncode in (0, 1, 3) and "Traceback" not in health.stderr, health.stderr


@pytest.mark.parametrize(("argv", "extra", "missing"), [
    (["run"], "operator", "kopf, kubernetes, aiohttp"),
    (["router", "--backend", "http://127.0.0.1:9"], "router", "aiohttp, kubernetes"),
    (["sim", "--served-model-name", "m"], "sim", "aiohttp"),
])
def test_commands_of_other_extras_fail_in_one_line_naming_theirs(
        installs: dict[str, Path], argv: list[str], extra: str, missing: str) -> None:
    done = _run(installs["worker"], "tensorfleet", *argv)
    assert done.returncode == 1
    assert done.stderr == (f"error: tensorfleet {argv[0]} needs the {extra} extra ({missing} not installed): "
                           f"pip install 'tensorfleet[{extra}]'\n")


def test_readme_quick_start_needs_only_the_base(installs: dict[str, Path]) -> None:
    bin_dir = installs["base"]
    installed = _distributions(bin_dir)
    assert not installed & {"kopf", "kubernetes", "aiohttp", "prometheus-client", "nvidia-ml-py"}, sorted(installed)
    plan = _run(bin_dir, "tensorfleet", "plan", "-f", str(EXAMPLE))
    assert plan.returncode == 0 and "KV cache size" in plan.stdout, plan.stderr
    rendered = _run(bin_dir, "tensorfleet", "render", "-f", str(EXAMPLE))
    assert rendered.returncode == 0 and "kind: StatefulSet" in rendered.stdout, rendered.stderr
    for argv in (["crd"], ["catalog"], ["rbac"], ["--help"]):
        assert _run(bin_dir, "tensorfleet", *argv).returncode == 0, argv
    # The launcher itself asks for its extra, in one line, with the launcher's exit code for "not installed".
    launched = _run(bin_dir, "tensorfleet-worker", env={"TF_MODEL": MODEL})
    assert launched.returncode == EXIT_NOT_FOUND
    assert launched.stderr == ("error: tensorfleet-worker needs the worker extra (prometheus_client not installed): "
                               "pip install 'tensorfleet[worker]'\n")
