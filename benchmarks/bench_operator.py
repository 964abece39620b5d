"""Operator benchmark: the real `tensorfleet run` process against the emulated API server,
or (--cluster) against the real control plane of `e2e/cluster up`.

Measures, for N InferenceServices created at once:
  - time until every one has converged (plan accepted, all groups ready, nothing progressing),
  - API writes the operator made on the way, by kind, per InferenceService, against the
    floor (one apply per child object),
  - API writes per minute once nothing changes (with a short resync so the idle
    reconciles actually run),
  - the operator process's resident memory (current and peak).

The emulator, and stand-ins for the StatefulSet/Deployment controllers, run in this
process; the operator runs as its own process, as in a cluster. Writes are counted on
the server side, from the operator's User-Agent.

    .venv/bin/python benchmarks/bench_operator.py --count 200 --idle-seconds 60
    eval "$(e2e/cluster up)" && .venv/bin/python benchmarks/bench_operator.py --cluster --count 200

With --cluster the operator is the one `e2e/cluster up` runs (its own process, under
the chart's ServiceAccount, --resync-seconds from e2e/kwok-values.yaml); the real
StatefulSet and Deployment controllers, scheduler and KWOK make the pods. Requests
are counted on the operator's side (tensorfleet_api_requests_total), reads (GET,
LIST) as well as writes. The benchmark adds fake CPU nodes for the pods (110 pods
each, like a kubelet's default) and removes them, with its namespace, afterwards.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from kmock import Server

from tensorfleet import contract
from tensorfleet.testing.fake_workloads import FakeWorkloads
from tensorfleet.testing.kube_emulator import WRITE_METHODS, ClusterEmulator
from tensorfleet.testing.loopback import free_port

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
SETTLE_SECONDS = 3.0



# Images the e2e cluster's pod runner does not run (it runs the control-plane image's pods as processes): KWOK
# makes these pods Ready, as it does GPU engines', so a thousand services cost no two thousand processes. The
# emulator run keeps the default images (nothing runs there).
BENCH_ROUTER_IMAGE = "bench.tensorfleet.invalid/router:kwok"
BENCH_ENGINE_IMAGES = ("bench.tensorfleet.invalid/engine:v1", "bench.tensorfleet.invalid/engine:v2")  # v2: the update


def _spec(name: str, *, kwok: bool = False) -> dict[str, Any]:
    """One InferenceService; KWOK: with images no pod runner runs."""
    spec: dict[str, Any] = {
        "model": {"name": "meta-llama/Llama-3.1-8B-Instruct", "maxModelLen": 8192},
        "engine": {"kind": "simulator"}, "accelerator": {"type": "L4"},
        "parallelism": {"tensor": 1, "pipeline": 1}, "replicas": 1, "router": {"replicas": 1},
    }
    if kwok:
        spec["engine"]["image"] = BENCH_ENGINE_IMAGES[0]
        spec["router"]["image"] = BENCH_ROUTER_IMAGE
    return {"apiVersion": contract.API_VERSION, "kind": contract.KIND,
            "metadata": {"name": name, "namespace": "bench"}, "spec": spec}


def _operator_writes(emulator: ClusterEmulator, start: int, end: int | None = None) -> Counter[str]:
    counts: Counter[str] = Counter()
    for request in list(emulator)[start:end]:
        if request.headers.get("User-Agent", "").startswith(contract.OPERATOR_COMPONENT) \
                and str(request.method.value).upper() in WRITE_METHODS and request.resource is not None:
            plural = request.resource.plural
            assert plural is not None, "the operator writes named resources"
            counts[plural + ("/" + request.subresource if request.subresource else "")] += 1
    return counts


def settled(isvc: dict[str, Any]) -> bool:
    """Ready, nothing progressing, and at its current generation."""
    status = isvc.get("status") or {}
    conditions = {c["type"]: c["status"] for c in status.get("conditions") or []}
    return conditions.get("Ready") == "True" and conditions.get("Progressing") == "False" \
        and status.get("observedGeneration") == isvc["metadata"]["generation"]


def _converged(emulator: ClusterEmulator, names: set[str]) -> int:
    return sum(1 for isvc in emulator.all(contract.API_VERSION, contract.PLURAL, "bench")
               if isvc["metadata"]["name"] in names and settled(isvc))


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss(pid: int) -> dict[str, float]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0]) / 1024
    return {"rss_mib": round(fields.get("VmRSS", 0), 1), "peak_rss_mib": round(fields.get("VmHWM", 0), 1)}


async def run(count: int, idle_seconds: float, resync_seconds: float, workers: int) -> dict[str, Any]:
    async with ClusterEmulator() as emulator, Server(emulator) as server:
        url = str(server.url).rstrip("/")
        workdir = Path(tempfile.mkdtemp())
        kubeconfig = workdir / "config"
        kubeconfig.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "emu",
            "clusters": [{"name": "emu", "cluster": {"server": url}}], "users": [{"name": "u", "user": {}}],
            "contexts": [{"name": "emu", "context": {"cluster": "emu", "user": "u"}}]}))
        health = free_port()
        async with FakeWorkloads(emulator, interval=0.5):
            process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "tensorfleet.cli", "run", "--no-leader-election", "--health-port", str(health),
                "--metrics-port", "0", "--resync-seconds", str(resync_seconds), "--workers", str(workers),
                env={**os.environ, "KUBECONFIG": str(kubeconfig)},
                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
            try:
                async with aiohttp.ClientSession() as session:
                    for _ in range(200):
                        try:
                            async with session.get(f"http://127.0.0.1:{health}/readyz") as response:
                                if response.status == 200:
                                    break
                        except aiohttp.ClientError:
                            pass
                        await asyncio.sleep(0.1)
                    names = {f"bench-{i:03d}" for i in range(count)}
                    start_index = len(list(emulator))
                    started = time.perf_counter()
                    path = f"{url}/apis/{contract.API_VERSION}/namespaces/bench/{contract.PLURAL}"
                    await asyncio.gather(*(session.post(path, json=_spec(n)) for n in sorted(names)))
                    while _converged(emulator, names) < count:
                        await asyncio.sleep(0.25)
                        if time.perf_counter() - started > 1800:
                            raise TimeoutError(f"only {_converged(emulator, names)} of {count} converged in 30 min")
                    converge_seconds = time.perf_counter() - started
                    converge_cpu = cpu_seconds(process.pid)
                # Events and status writes triggered by the last readiness change land
                # just after it; they belong to converging, not to the idle window.
                await asyncio.sleep(SETTLE_SECONDS)
                converge_index = len(list(emulator))
                create_writes = _operator_writes(emulator, start_index, converge_index)
                await asyncio.sleep(idle_seconds)
                idle_writes = _operator_writes(emulator, converge_index)
                memory = rss(process.pid)
            finally:
                process.send_signal(signal.SIGTERM)
                await asyncio.wait_for(process.wait(), 60)
    children_per_isvc = 9  # SA, Role, RoleBinding, 3 Services, PDB, StatefulSet, Deployment
    applies = sum(n for k, n in create_writes.items() if not k.endswith("/status") and k != "events")
    return {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        "inference_services": count,
        "converge_seconds": round(converge_seconds, 2),
        "operator_cpu_seconds_to_converge": round(converge_cpu, 2),
        "writes_to_converge": dict(sorted(create_writes.items())),
        "writes_per_inference_service": round(sum(create_writes.values()) / count, 2),
        "child_applies_per_inference_service": round(applies / count, 2),
        "floor_child_objects": children_per_isvc,
        "idle_seconds": idle_seconds,
        "resync_seconds": resync_seconds,
        "idle_writes": dict(idle_writes),
        "idle_writes_per_minute": round(sum(idle_writes.values()) * 60 / idle_seconds, 2),
        **memory,
    }


CLUSTER_SCRIPT = ROOT / "e2e" / "cluster"
BENCH_NAMESPACE = "bench"


def _kubectl(*args: str, stdin: str | None = None) -> str:
    import subprocess

    done = subprocess.run(["kubectl", *args], input=stdin, capture_output=True, text=True, timeout=600, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"kubectl {' '.join(args[:3])}: {done.stderr.strip()}")
    return done.stdout


def local_operator() -> tuple[int, int]:
    """(pid, metrics port) of the operator e2e/cluster runs."""
    import subprocess

    done = subprocess.run([str(CLUSTER_SCRIPT), "status", "--json"], capture_output=True, text=True, timeout=30,
                          check=False)
    operator = (json.loads(done.stdout or "null") or {}).get("operator") or {}
    if not operator.get("running") or not operator.get("metricsPort"):
        raise SystemExit(f"error: no local operator running (eval \"$(e2e/cluster up)\" first): {done.stdout.strip()!r}")
    # The pid e2e/cluster keeps is its supervisor's (e2e/supervise.py); the operator is its one child.
    supervisor = int(operator["pid"])
    children = Path(f"/proc/{supervisor}/task/{supervisor}/children").read_text().split()
    if len(children) != 1:
        raise SystemExit(f"error: the operator's supervisor (pid {supervisor}) runs {len(children)} processes, not 1")
    return int(children[0]), int(operator["metricsPort"])


def _requests(port: int) -> Counter[str]:
    """The operator's API requests ("METHOD Kind") and watch events handled ("watch Kind"), by its /metrics."""
    import urllib.request

    from tensorfleet import promtext

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    counts: Counter[str] = Counter()
    for sample in promtext.select(text, f"{contract.OPERATOR_METRIC_API_REQUESTS}_total"):
        counts[f"{sample.labels['method']} {sample.labels['kind']}"] += int(sample.value)
    for sample in promtext.select(text, f"{contract.OPERATOR_METRIC_WATCH_EVENTS}_total"):
        counts[f"watch {sample.labels['kind']}"] += int(sample.value)
    return counts


def _bench_nodes(count: int) -> list[dict[str, Any]]:
    capacity = {"cpu": "192", "memory": "2Ti", "pods": "110"}
    return [{"apiVersion": "v1", "kind": "Node",
             "metadata": {"name": f"bench-cpu-{i}", "labels": {"kubernetes.io/hostname": f"bench-cpu-{i}",
                                                               "type": "kwok", "tensorfleet.dev/bench": "true"},
                          "annotations": {"kwok.x-k8s.io/node": "fake"}},
             "spec": {"podCIDR": f"10.244.{100 + i}.0/24", "podCIDRs": [f"10.244.{100 + i}.0/24"]},
             "status": {"capacity": capacity, "allocatable": capacity}} for i in range(count)]


def wait_for(what: str, done: Any, bound: float = 1800) -> float:
    """Seconds until DONE() (a count left, 0 when done) reaches 0, polled every second."""
    started = time.perf_counter()
    while (left := done()) > 0:
        if time.perf_counter() - started > bound:
            raise TimeoutError(f"{what}: {left} left after {bound:.0f} s")
        time.sleep(1.0)
    return time.perf_counter() - started


def _unconverged(names: set[str]) -> int:
    """How many of NAMES are not Ready with nothing progressing at their current generation."""
    items = json.loads(_kubectl("get", contract.PLURAL, "-n", BENCH_NAMESPACE, "-o", "json"))["items"]
    return len(names) - sum(1 for isvc in items if isvc["metadata"]["name"] in names and settled(isvc))


def _left_behind(names: set[str]) -> int:
    """Objects still labelled with one of NAMES (the garbage collector removes a deleted one's children)."""
    labelled = json.loads(_kubectl("get", f"{contract.PLURAL},statefulsets,deployments,services,pods", "-n",
                                   BENCH_NAMESPACE, "-l", contract.LABEL_INFERENCE_SERVICE, "-o", "json"))["items"]
    return sum(1 for o in labelled if (o["metadata"].get("labels") or {}).get(contract.LABEL_INFERENCE_SERVICE) in names
               or (o["kind"] == contract.KIND and o["metadata"]["name"] in names))


def _split(requests: Counter[str]) -> tuple[dict[str, int], dict[str, int]]:
    """(writes, reads) by request, Lease renewals and watch events left out."""
    writes = {k: v for k, v in requests.items() if not k.startswith(("GET", "WATCH", "watch ")) and "Lease" not in k}
    reads = {k: v for k, v in requests.items() if k.startswith("GET") and "Lease" not in k}
    return dict(sorted(writes.items())), dict(sorted(reads.items()))


def run_cluster(count: int, idle_seconds: float, churn: float) -> dict[str, Any]:
    pid, port = local_operator()
    pods = count * 2  # one engine pod and one router pod each
    nodes = _bench_nodes(pods // 100 + 1)
    _kubectl("apply", "--validate=false", "-f", "-", stdin=json.dumps({"apiVersion": "v1", "kind": "List", "items": nodes}))
    _kubectl("create", "namespace", BENCH_NAMESPACE)
    try:
        names = {f"bench-{i:04d}" for i in range(count)}
        docs = [_spec(n, kwok=True) for n in sorted(names)]
        before = _requests(port)
        cpu_before = cpu_seconds(pid)
        _kubectl("create", "-f", "-", stdin=json.dumps({"apiVersion": "v1", "kind": "List", "items": docs}))
        converge_seconds = wait_for(f"{count} InferenceServices converging", lambda: _unconverged(names))
        converge_cpu = cpu_seconds(pid) - cpu_before
        time.sleep(SETTLE_SECONDS)
        converged = _requests(port)
        time.sleep(idle_seconds)
        idle = _requests(port)
        # Churn: CHURN of them get a new engine image at once (a rollout each), as many others are deleted at once.
        ordered = sorted(names)
        changed = set(ordered[:max(1, int(count * churn))])
        deleted = set(ordered[-max(1, int(count * churn)):]) - changed
        cpu_before = cpu_seconds(pid)
        patch = json.dumps({"spec": {"engine": {"image": BENCH_ENGINE_IMAGES[1]}}})
        for name in sorted(changed):
            _kubectl("patch", contract.PLURAL, name, "-n", BENCH_NAMESPACE, "--type=merge", "-p", patch)
        update_seconds = wait_for(f"{len(changed)} rollouts", lambda: _unconverged(changed))
        time.sleep(SETTLE_SECONDS)
        updated = _requests(port)
        _kubectl("delete", contract.PLURAL, "-n", BENCH_NAMESPACE, "--wait=false", *sorted(deleted))
        delete_seconds = wait_for(f"{len(deleted)} deletions", lambda: _left_behind(deleted))
        time.sleep(SETTLE_SECONDS)
        removed = _requests(port)
        churn_cpu = cpu_seconds(pid) - cpu_before
        memory = rss(pid)
    finally:
        _kubectl("delete", "namespace", BENCH_NAMESPACE, "--wait=true", "--timeout=900s")
        _kubectl("delete", "nodes", "-l", "tensorfleet.dev/bench=true")
    writes, reads = _split(converged - before)
    idle_writes, idle_reads = _split(idle - converged)
    update_writes, update_reads = _split(updated - idle)
    delete_writes, delete_reads = _split(removed - updated)

    def beyond(reads: dict[str, int], seconds: float) -> float:
        """READS less what the idle fleet reads anyway in SECONDS (each InferenceService's resync GET)."""
        return max(0.0, sum(reads.values()) - sum(idle_reads.values()) * seconds / idle_seconds)

    def watched(requests: Counter[str]) -> dict[str, int]:
        return {k.removeprefix("watch "): v for k, v in sorted(requests.items()) if k.startswith("watch ")}
    return {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        "api_server": _kubectl("version", "-o", "json") and json.loads(_kubectl("version", "-o", "json"))
        ["serverVersion"]["gitVersion"],
        "inference_services": count,
        "converge_seconds": round(converge_seconds, 2),
        "operator_cpu_seconds_to_converge": round(converge_cpu, 2),
        "writes_to_converge": writes,
        "writes_per_inference_service": round(sum(writes.values()) / count, 2),
        "reads_to_converge": reads,
        "reads_per_inference_service": round(sum(reads.values()) / count, 2),
        "watch_events_to_converge": watched(converged - before),
        "idle_seconds": idle_seconds,
        "idle_watch_events": sum(watched(idle - converged).values()),
        "idle_writes_per_minute": round(sum(idle_writes.values()) * 60 / idle_seconds, 2),
        "idle_reads_per_minute": round(sum(idle_reads.values()) * 60 / idle_seconds, 2),
        "updated": len(changed),
        "update_seconds": round(update_seconds, 2),
        "writes_per_update": round(sum(update_writes.values()) / len(changed), 2),
        "reads_per_update": round(sum(update_reads.values()) / len(changed), 2),
        "reads_per_update_beyond_idle": round(beyond(update_reads, update_seconds) / len(changed), 2),
        "deleted": len(deleted),
        "delete_seconds": round(delete_seconds, 2),
        "writes_per_delete": round(sum(delete_writes.values()) / max(1, len(deleted)), 2),
        "reads_per_delete": round(sum(delete_reads.values()) / max(1, len(deleted)), 2),
        "reads_per_delete_beyond_idle": round(beyond(delete_reads, delete_seconds) / max(1, len(deleted)), 2),
        "operator_cpu_seconds_in_churn": round(churn_cpu, 2),
        **memory,
    }


def _report(rows: list[tuple[str, Any]], result: dict[str, Any], file: str) -> None:
    """Print the table and keep the figures as JSON under benchmarks/results/."""
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key.ljust(width)}  {value}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / file).write_text(json.dumps(result, indent=2))


def main_cluster(args: argparse.Namespace) -> None:
    result = run_cluster(args.count, args.idle_seconds, args.churn)
    rows = [
        ("machine", result["machine"]),
        ("API server", f"{result['api_server']} (e2e/cluster: etcd, kube-apiserver, controllers, scheduler, KWOK)"),
        ("InferenceServices created at once", result["inference_services"]),
        ("time to converge (all Ready, nothing progressing)", f"{result['converge_seconds']} s"),
        ("  operator CPU time in that span", f"{result['operator_cpu_seconds_to_converge']} s"),
        ("API writes to converge, per InferenceService", result["writes_per_inference_service"]),
        ("  by request", ", ".join(f"{k} {v}" for k, v in result["writes_to_converge"].items())),
        ("API reads to converge, per InferenceService", result["reads_per_inference_service"]),
        ("watch events handled to converge", ", ".join(f"{k} {v}" for k, v in result["watch_events_to_converge"].items())),
        ("API writes / reads per minute, idle", f"{result['idle_writes_per_minute']} / {result['idle_reads_per_minute']}"),
        ("  watch events handled while idle", result["idle_watch_events"]),
        (f"{result['updated']} engine images changed at once: until all rolled out",
         (f"{result['update_seconds']} s, {result['writes_per_update']} writes, {result['reads_per_update']} reads "
         f"({result['reads_per_update_beyond_idle']} beyond the idle resync) each")),
        (f"{result['deleted']} deleted at once: until every child is gone",
         (f"{result['delete_seconds']} s, {result['writes_per_delete']} writes, {result['reads_per_delete']} reads "
         f"({result['reads_per_delete_beyond_idle']} beyond the idle resync) each")),
        ("  operator CPU time in the churn", f"{result['operator_cpu_seconds_in_churn']} s"),
        ("operator RSS (peak)", f"{result['rss_mib']} MiB ({result['peak_rss_mib']} MiB)"),
    ]
    _report(rows, result, "operator-cluster.json")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, default=200)
    parser.add_argument("--idle-seconds", type=float, default=60.0)
    parser.add_argument("--resync-seconds", type=float, default=15.0)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--churn", type=float, default=0.1,
                        help="--cluster: the share of InferenceServices updated at once, and deleted at once, after "
                             "the idle time (default 0.1)")
    parser.add_argument("--cluster", action="store_true",
                        help="against the cluster of e2e/cluster up (KUBECONFIG) and its operator process")
    args = parser.parse_args()
    if args.cluster:
        main_cluster(args)
        return
    result = asyncio.run(run(args.count, args.idle_seconds, args.resync_seconds, args.workers))
    rows = [
        ("machine", result["machine"]),
        ("InferenceServices created at once", result["inference_services"]),
        ("time to converge (all Ready, nothing progressing)", f"{result['converge_seconds']} s"),
        ("  operator CPU time in that span", f"{result['operator_cpu_seconds_to_converge']} s"),
        ("API writes to converge, per InferenceService", result["writes_per_inference_service"]),
        ("  of which child applies (floor: one per child)",
         f"{result['child_applies_per_inference_service']} (floor {result['floor_child_objects']})"),
        ("  by resource", ", ".join(f"{k} {v}" for k, v in result["writes_to_converge"].items())),
        (f"API writes per minute, idle (resync every {result['resync_seconds']:g} s)", result["idle_writes_per_minute"]),
        ("operator RSS (peak)", f"{result['rss_mib']} MiB ({result['peak_rss_mib']} MiB)"),
    ]
    _report(rows, result, "operator.json")


if __name__ == "__main__":
    main()
