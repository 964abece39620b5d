#!/usr/bin/env python3
"""Flux and a Git server in the e2e cluster: what `e2e/cluster up --gitops` starts on top of the cluster.

`e2e/cluster up --gitops` calls `start` after the operator is up (`down` calls `stop`, `status` shows it).
Everything runs as a local process on 127.0.0.1, built from Go modules like the control plane:

- Flux's source-controller, kustomize-controller (recipes e2e/build/flux-source and e2e/build/flux-kustomize,
  v1.9.x: v1.10 needs Go 1.27) and helm-controller (e2e/build/flux-helm, v1.6.4, the same Flux release),
  run with the cluster's admin kubeconfig, RUNTIME_NAMESPACE flux-system, leader election off,
  source-controller's artifact server on a loopback port it advertises to the other two.
  Their CRDs come from the same modules' config/crd/bases, applied server-side.
- A Git server (e2e/gitserver.py: git's own `git http-backend` over HTTP, fetch and push) serving the
  bare repository REPO_NAME under the state folder, made at `up` with one commit holding APPS_PATH.
- A GitRepository `flux-system/tensorfleet` on that repository's main branch and a Kustomization
  `flux-system/tensorfleet-apps` applying APPS_PATH with prune, wait (health by kstatus) and
  INTERVAL; pushing manifests there deploys them.

`exports` are the lines `up` prints: TF_GITOPS_REPO (a URL git can push to) and TF_GITOPS_PATH.
Only the Python standard library (it runs before any virtualenv exists). docs/gitops.md has what was
proven with it and how.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import monitoring  # e2e/monitoring.py: Kube, process and wait helpers

HERE = Path(__file__).resolve().parent
BUILD = HERE / "build"
NAMESPACE = "flux-system"
REPO_NAME = "tensorfleet.git"
APPS_PATH = "apps"
SOURCE = "tensorfleet"
APPS = "tensorfleet-apps"
INTERVAL = "10s"
HEALTH_TIMEOUT = "5m"
STATE_FILE = "gitops.json"
# (recipe, module, binary): the controllers, which e2e/cluster builds (its GITOPS_COMPONENTS are made from
# these), and where their CRDs come from.
CONTROLLERS = (
    ("flux-source", "github.com/fluxcd/source-controller", "source-controller"),
    ("flux-kustomize", "github.com/fluxcd/kustomize-controller", "kustomize-controller"),
    ("flux-helm", "github.com/fluxcd/helm-controller", "helm-controller"),
)
PROCESSES = ("git", *(binary for _recipe, _module, binary in CONTROLLERS))  # in start order
GIT_AUTHOR = {"GIT_AUTHOR_NAME": "tensorfleet-e2e", "GIT_AUTHOR_EMAIL": "e2e@tensorfleet.dev",
              "GIT_COMMITTER_NAME": "tensorfleet-e2e", "GIT_COMMITTER_EMAIL": "e2e@tensorfleet.dev"}


say = monitoring.say


def folder(state: Path) -> Path:
    return state / "gitops"


def load(state: Path) -> dict[str, Any]:
    return monitoring.read_json(folder(state) / STATE_FILE)


def save(state: Path, conf: dict[str, Any]) -> None:
    monitoring.write_json(folder(state) / STATE_FILE, conf)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def install_crds(kube: monitoring.Kube) -> list[str]:
    """Flux's CRDs (the controllers' modules' config/crd/bases), server-side applied; their names."""
    files = [file for recipe, module, _ in CONTROLLERS
             for file in sorted((monitoring.module_dir(BUILD / recipe, module) / "config" / "crd" / "bases")
                                .glob("*.yaml"))]
    return monitoring.apply_crds(kube, files, "Flux's modules' config/crd/bases")


def git(*args: str, cwd: Path | None = None) -> str:
    done = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=120, check=False,
                          env={**os.environ, **GIT_AUTHOR, "GIT_TERMINAL_PROMPT": "0"})
    if done.returncode != 0:
        raise RuntimeError(f"git {' '.join(args[:2])}: {(done.stderr.strip().splitlines() or ['?'])[-1]}")
    return done.stdout


def make_repository(state: Path) -> Path:
    """The bare repository, pushable over HTTP, with one commit on main holding APPS_PATH."""
    bare = folder(state) / "repos" / REPO_NAME
    shutil.rmtree(bare, ignore_errors=True)
    bare.parent.mkdir(parents=True, exist_ok=True)
    git("init", "--quiet", "--bare", "--initial-branch=main", str(bare))
    git("config", "http.receivepack", "true", cwd=bare)
    with tempfile.TemporaryDirectory(prefix="tensorfleet-gitops-") as work:
        seed = Path(work)
        git("init", "--quiet", "--initial-branch=main", str(seed))
        (seed / APPS_PATH).mkdir()
        (seed / APPS_PATH / "README.md").write_text(
            f"InferenceServices committed here are applied by the Flux Kustomization {NAMESPACE}/{APPS}.\n")
        git("add", ".", cwd=seed)
        git("commit", "--quiet", "-m", "The apps folder Flux applies", cwd=seed)
        git("push", "--quiet", str(bare), "main", cwd=seed)
    return bare


def flux_objects(repo_url: str) -> list[dict[str, Any]]:
    meta = {"namespace": NAMESPACE}
    return [
        {"apiVersion": "source.toolkit.fluxcd.io/v1", "kind": "GitRepository", "metadata": {"name": SOURCE, **meta},
         "spec": {"url": repo_url, "ref": {"branch": "main"}, "interval": INTERVAL, "timeout": "60s"}},
        {"apiVersion": "kustomize.toolkit.fluxcd.io/v1", "kind": "Kustomization", "metadata": {"name": APPS, **meta},
         "spec": {"sourceRef": {"kind": "GitRepository", "name": SOURCE}, "path": f"./{APPS_PATH}",
                  "interval": INTERVAL, "retryInterval": INTERVAL, "prune": True, "wait": True,
                  "timeout": HEALTH_TIMEOUT}},
    ]


def start(state: Path, kube: monitoring.Kube, binaries: dict[str, Path], kubeconfig: Path) -> dict[str, Any]:
    """The Git server, Flux's CRDs and controllers, the repository's GitRepository and Kustomization; waits
    until the Kustomization is Ready on the first commit."""
    if shutil.which("git") is None:
        raise RuntimeError("git is not installed (the GitOps repository is served by git http-backend)")
    folder(state).mkdir(parents=True, exist_ok=True)
    conf: dict[str, Any] = {"kubeconfig": str(kubeconfig), "kubectl": kube.kubectl,
                            "check": str(binaries["gitops-check"])}
    bare = make_repository(state)
    port = free_port()
    conf["git"] = {"pid": monitoring.spawn(state, "gitserver", [sys.executable, str(HERE / "gitserver.py"), "--root",
                                                                str(bare.parent), "--port", str(port)],
                                           where=folder(state)), "port": port}
    conf["repo"] = f"http://127.0.0.1:{port}/{REPO_NAME}"
    save(state, conf)
    monitoring.wait_for("the Git server", lambda: git("ls-remote", conf["repo"], "main").strip(), 30)
    names = install_crds(kube)
    kube.run("create", "namespace", NAMESPACE, check=False)
    env = {"RUNTIME_NAMESPACE": NAMESPACE, "KUBECONFIG": str(kubeconfig)}
    storage = free_port()
    (folder(state) / "artifacts").mkdir(exist_ok=True)  # source-controller refuses a storage path that is absent
    for _recipe, _module, binary in CONTROLLERS:
        metrics, health = free_port(), free_port()
        argv = [str(binaries[binary]), "--enable-leader-election=false",
                "--watch-all-namespaces=true", f"--metrics-addr=127.0.0.1:{metrics}",
                f"--health-addr=127.0.0.1:{health}", "--log-level=info"]
        if binary == "source-controller":
            argv += [f"--storage-path={folder(state) / 'artifacts'}", f"--storage-addr=127.0.0.1:{storage}",
                     f"--storage-adv-addr=127.0.0.1:{storage}"]
        conf[binary] = {"pid": monitoring.spawn(state, binary, argv, where=folder(state), env=env),
                        "metrics": metrics, "health": health}
        save(state, conf)
    for _recipe, _module, binary in CONTROLLERS:
        part = conf[binary]

        def ready(part: dict[str, Any] = part, binary: str = binary) -> bool:
            if not monitoring.alive(part["pid"]):
                raise monitoring.Fatal(f"{binary} exited: {monitoring.log_tail(state, binary, where=folder(state))}")
            return monitoring.http_ok(f"http://127.0.0.1:{part['health']}/readyz")

        monitoring.wait_for(f"{binary} ready", ready, 120)
    kube.apply(flux_objects(conf["repo"]))
    kube.run("wait", f"--namespace={NAMESPACE}", "--for=condition=Ready", "--timeout=180s",
             f"kustomization/{APPS}", timeout=200)
    conf["crds"] = names
    save(state, conf)
    say(f"Flux up: {conf['repo']} ({APPS_PATH}/) applied by {NAMESPACE}/{APPS} every {INTERVAL}")
    return conf


def exports(state: Path) -> str:
    conf = load(state)
    if not conf.get("repo"):
        return ""
    return f"export TF_GITOPS_REPO={conf['repo']}\nexport TF_GITOPS_PATH={APPS_PATH}\n"


def stop(state: Path) -> None:
    """Stop what `start` started (the controllers first, then the Git server); nothing else."""
    conf = load(state)
    for name in reversed(PROCESSES):
        pid = (conf.get(name) or {}).get("pid")
        if monitoring.alive(pid):
            monitoring.terminate(pid)
            say(f"{name} (pid {pid}) stopped")


def status(state: Path) -> dict[str, Any] | None:
    conf = load(state)
    if not conf.get("repo"):
        return None
    out: dict[str, Any] = {"repo": conf["repo"], "path": APPS_PATH, "kustomization": f"{NAMESPACE}/{APPS}",
                           "check": conf.get("check")}
    for name in PROCESSES:
        part = dict(conf.get(name) or {})
        part["running"] = monitoring.alive(part.get("pid"))
        part["log"] = str(folder(state) / f"{'gitserver' if name == 'git' else name}.log")
        out[name] = part
    return out


if __name__ == "__main__":
    sys.exit("e2e/gitops.py is driven by e2e/cluster (up --gitops, down, status)")
