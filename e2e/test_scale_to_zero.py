"""Scale to zero and back on the real control plane: the operator's idle period, the demand Lease renewed with
the router's own token (its Role may patch that Lease and no other), every stage of a multi-node replica going
to zero and coming back, and the HPA never fought over spec.replicas.
"""

from __future__ import annotations

import datetime
from pathlib import Path

from kube import apply, condition, eventually, example, get, kubectl, kubectl_result, token_kubeconfig, wait_ready

from tensorfleet import contract

IDLE_SECONDS = 30  # the API's least


def _replicas(name: str, namespace: str, stages: int) -> set[int]:
    return {int(((get("statefulset", contract.stage_name(name, k), namespace) or {}).get("spec") or {})
                .get("replicas", -1)) for k in range(stages)}


def _renew(kubeconfig: Path, name: str, namespace: str, lease: str | None = None) -> str:
    """What a router does on a request: server-side apply of the Lease's renewal, with the router's token."""
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    doc = (f'{{"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": {{"name": '
           f'"{lease or contract.demand_lease_name(name)}", "namespace": "{namespace}"}}, "spec": '
           f'{{"holderIdentity": "e2e-router", "renewTime": "{now}"}}}}')
    result = kubectl_result("--kubeconfig", str(kubeconfig), "apply", "--server-side", "--force-conflicts",
                            f"--field-manager={contract.ROUTER_COMPONENT}", "-f", "-", stdin=doc)
    return result.stdout + result.stderr if result.returncode else ""


def test_an_idle_fleet_goes_to_zero_and_the_routers_lease_wakes_it(namespace: str, tmp_path: Path) -> None:
    doc = example("simulator-cpu.yaml", namespace,
                  autoscaling={"minReplicas": 0, "maxReplicas": 3, "scaleToZeroAfterSeconds": IDLE_SECONDS})
    doc["spec"].pop("replicas", None)
    name = doc["metadata"]["name"]
    stages = doc["spec"]["parallelism"]["pipeline"]
    apply(doc)
    wait_ready(name, namespace)
    assert _replicas(name, namespace, stages) == {1}
    hpa = get("horizontalpodautoscaler", contract.hpa_name(name), namespace)
    assert hpa is not None and hpa["spec"]["minReplicas"] == 1
    lease = eventually("the demand Lease", lambda: get("lease", contract.demand_lease_name(name), namespace))
    assert lease["metadata"]["ownerReferences"][0]["name"] == name

    # The router's own token: it may renew its Lease, and nothing else.
    router_config = token_kubeconfig(contract.router_name(name), namespace, tmp_path / "router.kubeconfig")
    denied = _renew(router_config, name, namespace, lease="someone-elses")
    assert "forbidden" in denied.lower(), denied
    can_i = kubectl_result("--kubeconfig", str(router_config), "auth", "can-i", "create", "leases", "-n", namespace)
    assert can_i.stdout.strip() == "no"

    # Idle for the period: every stage goes to zero, Ready stays True (the router takes requests).
    eventually("every stage at zero", lambda: _replicas(name, namespace, stages) == {0}, timeout=IDLE_SECONDS + 60)
    obj = eventually("status.idleSince", lambda: (o := get(contract.PLURAL, name, namespace)) and
                     (o.get("status") or {}).get("idleSince") and o)
    ready = condition(obj, "Ready")
    assert ready is not None and (ready["status"], ready["reason"]) == ("True", "ScaledToZero"), ready
    assert obj["spec"]["replicas"] == 1, "the operator never writes the HPA's field"
    events = kubectl("get", "events", "-n", namespace, "--field-selector", f"involvedObject.name={name}",
                     "-o", "jsonpath={.items[*].reason}")
    assert "ScaledToZero" in events.split()

    # A request arrives at a router: it renews the Lease; that write alone wakes the fleet.
    assert _renew(router_config, name, namespace) == ""
    eventually("every stage back at 1", lambda: _replicas(name, namespace, stages) == {1}, timeout=60)
    obj = eventually("serving again", lambda: (o := get(contract.PLURAL, name, namespace))
                     and (condition(o, "Ready") or {}).get("reason") == "Serving" and o)
    assert "idleSince" not in (obj.get("status") or {})
