"""Churn soak on the real control plane (issue 36): InferenceServices created, updated, scaled, reshaped and
deleted at random for an hour under traffic; at the end every one has converged, none has a child missing, extra,
orphaned or left behind, and the operator's and routers' memory has a measured slope.

    eval "$(e2e/cluster up)" && .venv/bin/python benchmarks/bench_soak.py --minutes 60

It needs the cluster of `e2e/cluster up` and its pod runner: the engines (`engine.kind: simulator`) and the
routers run as processes, so every request goes through a real router to a real engine. Two anchor services stay
up throughout with a client each sending chat completions one after another; they are scaled and get new engine
images (rollouts) but are never deleted or reshaped, so their routers live the whole hour and their RSS can be
followed. Up to --services others come and go; they are also reshaped (pipeline 1 <-> 2, which changes the set of
StatefulSets). Every loop is bounded in count and time; the namespace is deleted at the end.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from collections import Counter
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from bench_operator import cpu_seconds, local_operator, rss, settled, wait_for
from common import write_results

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "e2e"))   # e2e/kube.py, the e2e tests' helpers
from kube import (
    NEXT_IMAGE,
    OWN_KINDS,
    Requests,
    cluster_status,
    example,
    get,
    items,
    kubectl,
    router_url,
)

from tensorfleet import contract
from tensorfleet.kube.resources import kind_of

NAMESPACE = "soak"
ANCHORS = ("anchor-a", "anchor-b")
SETTLE_S = 600.0   # after the churn stops: every service converged within this, every deleted one's children gone
WARM_UP = 0.1      # the slope leaves out the first tenth of the samples (imports, caches, connection pools filling)


@dataclass
class Soak:
    rng: random.Random
    limit: int
    born: int = 0
    live: dict[str, dict[str, Any]] = field(default_factory=dict)   # name -> the spec last written
    deleted: set[str] = field(default_factory=set)
    actions: Counter[str] = field(default_factory=Counter)


def _doc(name: str) -> dict[str, Any]:
    doc = example("simulator-cpu.yaml", NAMESPACE, replicas=1, autoscaling=None,
                  parallelism={"tensor": 1, "pipeline": 1})
    doc["metadata"]["name"] = name
    return doc


def _patch(name: str, spec: dict[str, Any]) -> None:
    kubectl("patch", contract.PLURAL, name, "-n", NAMESPACE, "--type=merge", "-p", json.dumps({"spec": spec}))


def _step(soak: Soak) -> str:
    """One random change; its name."""
    others = sorted(n for n in soak.live if n not in ANCHORS)
    choices = ["scale", "image"] + (["create"] if len(others) < soak.limit else []) \
        + (["delete", "reshape"] if others else [])
    action = soak.rng.choice(choices)
    if action == "create":
        soak.born += 1
        name = f"churn-{soak.born:03d}"
        doc = _doc(name)
        kubectl("create", "-f", "-", stdin=json.dumps(doc))
        soak.live[name] = doc["spec"]
    elif action == "delete":
        name = soak.rng.choice(others)
        kubectl("delete", contract.PLURAL, name, "-n", NAMESPACE, "--wait=false")
        soak.live.pop(name)
        soak.deleted.add(name)
    else:
        name = soak.rng.choice(sorted(soak.live) if action != "reshape" else others)
        spec = soak.live[name]
        if action == "scale":
            change: dict[str, Any] = {"replicas": 3 - int(spec.get("replicas", 1))}   # 1 <-> 2
        elif action == "image":
            change = {"engine": {**spec["engine"], "image": None if spec["engine"].get("image") else NEXT_IMAGE}}
        else:
            change = {"parallelism": {"tensor": 1, "pipeline": 3 - int(spec["parallelism"]["pipeline"])}}
        _patch(name, change)
        spec.update(change)
        spec["engine"] = {k: v for k, v in spec["engine"].items() if v is not None}
    soak.actions[action] += 1
    return action


def _router_pid(name: str) -> int | None:
    """The pid of NAME's one router container, run by the pod runner."""
    found = [c["pid"] for pod in ((cluster_status() or {}).get("podRunner") or {}).get("pods") or []
             if pod["namespace"] == NAMESPACE and pod["name"].startswith(contract.router_name(name) + "-")
             for c in pod.get("containers") or [] if c.get("pid")]
    return int(found[0]) if len(found) == 1 else None


def _operator_restarts() -> int:
    return int(((cluster_status() or {}).get("operator") or {}).get("restarts", 0))


def _slope(samples: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, MiB) after the warm-up, in MiB per hour."""
    kept = samples[int(len(samples) * WARM_UP):]
    if len(kept) < 3:
        return float("nan")
    mean_t = sum(t for t, _ in kept) / len(kept)
    mean_v = sum(v for _, v in kept) / len(kept)
    spread = sum((t - mean_t) ** 2 for t, _ in kept)
    return sum((t - mean_t) * (v - mean_v) for t, v in kept) / spread * 3600 if spread else float("nan")


def _converged(name: str) -> bool:
    obj = get(contract.PLURAL, name, NAMESPACE)
    return obj is not None and settled(obj)


def _expected(name: str) -> set[str]:
    """Kind/name of every object the operator should own for NAME as it is now (`tensorfleet render` of it)."""
    obj = get(contract.PLURAL, name, NAMESPACE)
    assert obj is not None, name
    done = subprocess.run([str(Path(sys.executable).parent / "tensorfleet"), "render", "-f", "-"], input=json.dumps(obj),
                          capture_output=True, text=True, timeout=60, check=True)
    plurals = set(OWN_KINDS.split(","))
    return {f"{o['kind']}/{o['metadata']['name']}" for o in yaml.safe_load_all(done.stdout)
            if o and kind_of(o).plural in plurals}


def _audit(soak: Soak) -> dict[str, Any]:
    """Missing, extra, orphaned children of every live service; children left behind by deleted ones."""
    owned = items(OWN_KINDS, NAMESPACE, contract.LABEL_INFERENCE_SERVICE)
    pods = items("pods", NAMESPACE, contract.LABEL_INFERENCE_SERVICE)
    uids = {n: (get(contract.PLURAL, n, NAMESPACE) or {}).get("metadata", {}).get("uid") for n in soak.live}
    found: dict[str, set[str]] = {}
    orphaned, left_behind = [], []
    for obj in owned + pods:
        meta = obj["metadata"]
        owner = meta["labels"][contract.LABEL_INFERENCE_SERVICE]
        what = f"{obj['kind']}/{meta['name']}"
        if owner not in soak.live:
            left_behind.append(what)
        elif obj["kind"] != "Pod":
            found.setdefault(owner, set()).add(what)
            if [r["uid"] for r in meta.get("ownerReferences") or []] != [uids[owner]]:
                orphaned.append(what)
    missing, extra = [], []
    for name in sorted(soak.live):
        expected, actual = _expected(name), found.get(name, set())
        missing += sorted(expected - actual)
        extra += sorted(actual - expected)
    return {"missing": missing, "extra": extra, "orphaned": sorted(orphaned), "left_behind": sorted(left_behind)}


def run(minutes: float, services: int, every: float, sample_every: float, seed: int) -> dict[str, Any]:
    operator_pid, _port = local_operator()
    restarts_before = _operator_restarts()
    if get("namespace", NAMESPACE, None) is not None:
        raise SystemExit(f"error: namespace {NAMESPACE} exists (an earlier run's?): kubectl delete namespace {NAMESPACE}")
    kubectl("create", "namespace", NAMESPACE)
    soak = Soak(random.Random(seed), services)
    try:
        for name in ANCHORS:
            doc = _doc(name)
            kubectl("create", "-f", "-", stdin=json.dumps(doc))
            soak.live[name] = doc["spec"]
        wait_for("the anchors converging", lambda: sum(not _converged(n) for n in ANCHORS), bound=300)
        model = soak.live[ANCHORS[0]]["model"]["servedName"]
        routers = {name: _router_pid(name) for name in ANCHORS}
        seconds = minutes * 60
        loads = [Requests(router_url(name, NAMESPACE), model, limit=10 ** 6, seconds=seconds + SETTLE_S)
                 for name in ANCHORS]
        clients = ExitStack()
        for load in loads:
            clients.enter_context(load)
        samples: dict[str, list[tuple[float, float]]] = {"operator": [], **{f"router {n}": [] for n in ANCHORS}}
        started = time.monotonic()
        first_pid, cpu_at_start = operator_pid, cpu_seconds(operator_pid)
        next_action = next_sample = started
        try:
            while (now := time.monotonic()) - started < seconds:
                if now >= next_sample:
                    operator_pid, _port = local_operator()   # another process once its supervisor restarted it
                    samples["operator"].append((now - started, rss(operator_pid)["rss_mib"]))
                    for name, pid in routers.items():
                        if pid is not None:
                            samples[f"router {name}"].append((now - started, rss(pid)["rss_mib"]))
                    next_sample += sample_every
                if now >= next_action:
                    _step(soak)
                    next_action += soak.rng.expovariate(1 / every)
                time.sleep(max(0.0, min(next_action, next_sample) - time.monotonic()))
            # The CPU time of one process: none to report across an operator restart.
            churn_cpu = cpu_seconds(operator_pid) - cpu_at_start if operator_pid == first_pid else float("nan")
            settle_started = time.monotonic()
            while time.monotonic() - settle_started < SETTLE_S:
                audit = _audit(soak)
                unconverged = [n for n in sorted(soak.live) if not _converged(n)]
                if not unconverged and not any(audit.values()):
                    break
                time.sleep(5)
            settled = time.monotonic() - settle_started
        finally:
            clients.close()
        moved = [n for n, pid in routers.items() if pid is None or _router_pid(n) != pid]
        codes = [code for load in loads for code in load.codes]
        failed = Counter(str(code) for code in codes if code != 200)
        return {
            "minutes": minutes, "seed": seed, "actions": dict(soak.actions), "services_at_end": len(soak.live),
            "services_created": soak.born + len(ANCHORS), "services_deleted": len(soak.deleted),
            "settle_seconds": round(settled, 1), "unconverged": unconverged, **audit,
            "requests": len(codes), "failed": dict(failed), "routers_replaced": moved,
            "operator_restarts": _operator_restarts() - restarts_before,
            "operator_cpu_seconds": round(churn_cpu, 1),
            "rss_mib": {k: [v[0][1], v[-1][1]] if v else [] for k, v in samples.items()},
            "rss_slope_mib_per_hour": {k: round(_slope(v), 2) for k, v in samples.items()},
            "samples": samples,
        }
    finally:
        kubectl("delete", "namespace", NAMESPACE, "--wait=false", check=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=60.0, help="how long the churn runs (default 60)")
    parser.add_argument("--services", type=int, default=4,
                        help="at most this many churned services at a time, besides the two anchors (default 4)")
    parser.add_argument("--every", type=float, default=20.0, help="mean seconds between changes (default 20)")
    parser.add_argument("--sample-every", type=float, default=30.0, help="seconds between RSS samples (default 30)")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    result = run(args.minutes, args.services, args.every, args.sample_every, args.seed)
    path = write_results("soak", result)
    for key, value in result.items():
        if key != "samples":
            print(f"{key}: {value}")
    print(f"figures: {path}")
    bad = result["unconverged"] or result["missing"] or result["extra"] or result["orphaned"] or result["left_behind"]
    raise SystemExit(1 if bad else 0)


if __name__ == "__main__":
    main()
