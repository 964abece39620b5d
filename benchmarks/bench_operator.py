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



def _spec(name: str) -> dict[str, Any]:
    return {
        "apiVersion": contract.API_VERSION, "kind": contract.KIND,
        "metadata": {"name": name, "namespace": "bench"},
        "spec": {"model": {"name": "meta-llama/Llama-3.1-8B-Instruct", "maxModelLen": 8192},
                 "engine": {"kind": "simulator"}, "accelerator": {"type": "L4"},
                 "parallelism": {"tensor": 1, "pipeline": 1}, "replicas": 1, "router": {"replicas": 1}},
    }


def _operator_writes(emulator: ClusterEmulator, start: int, end: int | None = None) -> Counter[str]:
    counts: Counter[str] = Counter()
    for request in list(emulator)[start:end]:
        if request.headers.get("User-Agent", "").startswith(contract.OPERATOR_COMPONENT) \
                and str(request.method.value).upper() in WRITE_METHODS and request.resource is not None:
            plural = request.resource.plural
            assert plural is not None, "the operator writes named resources"
            counts[plural + ("/" + request.subresource if request.subresource else "")] += 1
    return counts


def _converged(emulator: ClusterEmulator, names: set[str]) -> int:
    done = 0
    for isvc in emulator.all(contract.API_VERSION, contract.PLURAL, "bench"):
        status = isvc.get("status") or {}
        conditions = {c["type"]: c["status"] for c in status.get("conditions") or []}
        if isvc["metadata"]["name"] in names and conditions.get("Ready") == "True" \
                and conditions.get("Progressing") == "False" \
                and status.get("observedGeneration") == isvc["metadata"]["generation"]:
            done += 1
    return done


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _rss(pid: int) -> dict[str, float]:
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
                    converge_cpu = _cpu_seconds(process.pid)
                # Events and status writes triggered by the last readiness change land
                # just after it; they belong to converging, not to the idle window.
                await asyncio.sleep(SETTLE_SECONDS)
                converge_index = len(list(emulator))
                create_writes = _operator_writes(emulator, start_index, converge_index)
                await asyncio.sleep(idle_seconds)
                idle_writes = _operator_writes(emulator, converge_index)
                memory = _rss(process.pid)
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


def _local_operator() -> tuple[int, int]:
    """(pid, metrics port) of the operator e2e/cluster runs."""
    import subprocess

    done = subprocess.run([str(CLUSTER_SCRIPT), "status", "--json"], capture_output=True, text=True, timeout=30,
                          check=False)
    operator = (json.loads(done.stdout or "null") or {}).get("operator") or {}
    if not operator.get("running") or not operator.get("metricsPort"):
        raise SystemExit(f"error: no local operator running (eval \"$(e2e/cluster up)\" first): {done.stdout.strip()!r}")
    return int(operator["pid"]), int(operator["metricsPort"])


def _requests(port: int) -> Counter[str]:
    import urllib.request

    from tensorfleet import promtext

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    counts: Counter[str] = Counter()
    for sample in promtext.select(text, "tensorfleet_api_requests_total"):
        counts[f"{sample.labels['method']} {sample.labels['kind']}"] += int(sample.value)
    return counts


def _bench_nodes(count: int) -> list[dict[str, Any]]:
    capacity = {"cpu": "192", "memory": "2Ti", "pods": "110"}
    return [{"apiVersion": "v1", "kind": "Node",
             "metadata": {"name": f"bench-cpu-{i}", "labels": {"kubernetes.io/hostname": f"bench-cpu-{i}",
                                                               "type": "kwok", "tensorfleet.dev/bench": "true"},
                          "annotations": {"kwok.x-k8s.io/node": "fake"}},
             "spec": {"podCIDR": f"10.244.{100 + i}.0/24", "podCIDRs": [f"10.244.{100 + i}.0/24"]},
             "status": {"capacity": capacity, "allocatable": capacity}} for i in range(count)]


def run_cluster(count: int, idle_seconds: float) -> dict[str, Any]:
    pid, port = _local_operator()
    pods = count * 2  # one engine pod and one router pod each
    nodes = _bench_nodes(pods // 100 + 1)
    _kubectl("apply", "--validate=false", "-f", "-", stdin=json.dumps({"apiVersion": "v1", "kind": "List", "items": nodes}))
    _kubectl("create", "namespace", BENCH_NAMESPACE)
    try:
        names = {f"bench-{i:03d}" for i in range(count)}
        docs = [_spec(n) for n in sorted(names)]
        before = _requests(port)
        cpu_before = _cpu_seconds(pid)
        started = time.perf_counter()
        _kubectl("create", "-f", "-", stdin=json.dumps({"apiVersion": "v1", "kind": "List", "items": docs}))
        while True:
            items = json.loads(_kubectl("get", contract.PLURAL, "-n", BENCH_NAMESPACE, "-o", "json"))["items"]
            done = 0
            for isvc in items:
                status = isvc.get("status") or {}
                conditions = {c["type"]: c["status"] for c in status.get("conditions") or []}
                if conditions.get("Ready") == "True" and conditions.get("Progressing") == "False" \
                        and status.get("observedGeneration") == isvc["metadata"]["generation"]:
                    done += 1
            if done == count:
                break
            if time.perf_counter() - started > 1800:
                raise TimeoutError(f"only {done} of {count} converged in 30 min")
            time.sleep(1.0)
        converge_seconds = time.perf_counter() - started
        converge_cpu = _cpu_seconds(pid) - cpu_before
        time.sleep(SETTLE_SECONDS)
        converged = _requests(port)
        time.sleep(idle_seconds)
        idle = _requests(port)
        memory = _rss(pid)
    finally:
        _kubectl("delete", "namespace", BENCH_NAMESPACE, "--wait=true", "--timeout=600s")
        _kubectl("delete", "nodes", "-l", "tensorfleet.dev/bench=true")
    to_converge = converged - before
    idle_requests = idle - converged
    writes = {k: v for k, v in to_converge.items() if not k.startswith("GET") and "Lease" not in k}
    reads = {k: v for k, v in to_converge.items() if k.startswith("GET")}
    idle_writes = {k: v for k, v in idle_requests.items() if not k.startswith("GET") and "Lease" not in k}
    idle_reads = {k: v for k, v in idle_requests.items() if k.startswith("GET")}
    return {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        "api_server": _kubectl("version", "-o", "json") and json.loads(_kubectl("version", "-o", "json"))
        ["serverVersion"]["gitVersion"],
        "inference_services": count,
        "converge_seconds": round(converge_seconds, 2),
        "operator_cpu_seconds_to_converge": round(converge_cpu, 2),
        "writes_to_converge": dict(sorted(writes.items())),
        "writes_per_inference_service": round(sum(writes.values()) / count, 2),
        "reads_to_converge": dict(sorted(reads.items())),
        "reads_per_inference_service": round(sum(reads.values()) / count, 2),
        "idle_seconds": idle_seconds,
        "idle_writes_per_minute": round(sum(idle_writes.values()) * 60 / idle_seconds, 2),
        "idle_reads_per_minute": round(sum(idle_reads.values()) * 60 / idle_seconds, 2),
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
    result = run_cluster(args.count, args.idle_seconds)
    rows = [
        ("machine", result["machine"]),
        ("API server", f"{result['api_server']} (e2e/cluster: etcd, kube-apiserver, controllers, scheduler, KWOK)"),
        ("InferenceServices created at once", result["inference_services"]),
        ("time to converge (all Ready, nothing progressing)", f"{result['converge_seconds']} s"),
        ("  operator CPU time in that span", f"{result['operator_cpu_seconds_to_converge']} s"),
        ("API writes to converge, per InferenceService", result["writes_per_inference_service"]),
        ("  by request", ", ".join(f"{k} {v}" for k, v in result["writes_to_converge"].items())),
        ("API reads to converge, per InferenceService", result["reads_per_inference_service"]),
        ("API writes / reads per minute, idle", f"{result['idle_writes_per_minute']} / {result['idle_reads_per_minute']}"),
        ("operator RSS (peak)", f"{result['rss_mib']} MiB ({result['peak_rss_mib']} MiB)"),
    ]
    _report(rows, result, "operator-cluster.json")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, default=200)
    parser.add_argument("--idle-seconds", type=float, default=60.0)
    parser.add_argument("--resync-seconds", type=float, default=15.0)
    parser.add_argument("--workers", type=int, default=4)
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
