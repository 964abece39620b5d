"""GitOps for real: Flux reconciling InferenceServices pushed to the e2e cluster's Git server, and the GitOps tools'
own health code judging InferenceServices in each state.

`e2e/cluster up --gitops` (.ci/run brings the cluster up so) builds Flux's source-controller and
kustomize-controller from their Go modules and runs them against the cluster, with a Git server (git's own
http-backend) holding the repository that the Kustomization flux-system/tensorfleet-apps applies (prune,
wait: health by kstatus). The tests here push commits to it as a platform team would and watch what Flux and
the operator make of them; kstatus (sigs.k8s.io/cli-utils, what Flux's health checks compute) and Argo CD's
health script (charts/tensorfleet/README.md, run in gopher-lua, the VM Argo CD embeds) judge objects the
real cluster wrote. The flow tests share one namespace and one folder of the repository, in order, as one
team's history. docs/gitops.md says what is proven and how to repeat it by hand.
"""

from __future__ import annotations

import base64
import gzip
import json
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import gitops
import pytest
import yaml
from kube import (
    NEXT_IMAGE,
    RELEASE,
    ROOT,
    SYSTEM_NAMESPACE,
    TIMEOUT,
    Requests,
    cluster_status,
    condition,
    delete_namespace_later,
    engine_pods,
    eventually,
    example,
    get,
    isvc,
    items,
    kubectl,
    kubectl_result,
    new_namespace,
    router_url,
    wait_ready,
)

from tensorfleet import contract, promtext

FLUX_NAMESPACE = "flux-system"
KUSTOMIZATION = "kustomization.kustomize.toolkit.fluxcd.io"
GIT_REPOSITORY = "gitrepository.source.toolkit.fluxcd.io"
HELM_RELEASE = "helmrelease.helm.toolkit.fluxcd.io"
APPS = "tensorfleet-apps"
SOURCE = "tensorfleet"
INTERVAL_S = 10  # the Kustomization's and the GitRepository's (e2e/gitops.py)
CHART = ROOT / "charts" / "tensorfleet"
CHART_README = CHART / "README.md"
CHART_IN_GIT = "charts/tensorfleet"  # beside the apps folder, not in it: the Kustomization must not apply templates
CRD = f"customresourcedefinitions/{contract.PLURAL}.{contract.GROUP}"
AUTHOR = ["-c", "user.name=tensorfleet-e2e", "-c", "user.email=e2e@tensorfleet.dev"]


def _gitops() -> dict[str, Any]:
    found = (cluster_status() or {}).get("gitops")
    if not found or not all(found[p]["running"] for p in gitops.PROCESSES):
        pytest.fail("needs Flux and the Git server of `e2e/cluster up --gitops` (.ci/run brings the cluster up so); "
                    f"status: {found!r}")
    return dict(found)


class Repo:
    """A clone of the GitOps repository: write files under the apps folder, commit, push."""

    def __init__(self, url: str, path: str, work: Path) -> None:
        self.path, self.work = path, work
        self.git("clone", "--quiet", url, str(work), cwd=work.parent)

    def git(self, *args: str, cwd: Path | None = None) -> str:
        done = subprocess.run(["git", *AUTHOR, *args], cwd=cwd or self.work, capture_output=True, text=True,
                              timeout=120, check=False)
        assert done.returncode == 0, f"git {' '.join(args)}: {done.stderr.strip()}"
        return done.stdout

    def commit(self, files: dict[str, Any], message: str) -> str:
        """Write (a document or a list of them) or delete (None) FILES under the apps folder, commit and push;
        the new commit's SHA."""
        self.git("pull", "--quiet", "--ff-only")
        for name, docs in files.items():
            target = self.work / self.path / name
            if docs is None:
                target.unlink(missing_ok=True)
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(yaml.safe_dump_all(docs if isinstance(docs, list) else [docs], sort_keys=False))
        self.git("add", "--all", ".")
        self.git("commit", "--quiet", "--allow-empty", "-m", message)
        self.git("push", "--quiet", "origin", "main")
        return self.git("rev-parse", "HEAD").strip()


def _kustomization() -> dict[str, Any]:
    found = get(KUSTOMIZATION, APPS, FLUX_NAMESPACE)
    assert found is not None, f"no Kustomization {FLUX_NAMESPACE}/{APPS}"
    return found


def _reconcile_now() -> None:
    """What `flux reconcile kustomization --with-source` does: ask both for a reconciliation now. (A HelmChart
    built from the GitRepository follows its new artifact, and a HelmRelease its HelmChart's, on their own.)"""
    stamp = datetime.now(UTC).isoformat()
    for kind, name in ((GIT_REPOSITORY, SOURCE), (KUSTOMIZATION, APPS)):
        kubectl("annotate", "--overwrite", kind, name, "-n", FLUX_NAMESPACE, f"reconcile.fluxcd.io/requestedAt={stamp}")


def _revision(sha: str) -> str:
    return f"main@sha1:{sha}"


def _applied(sha: str) -> dict[str, Any] | None:
    """The Kustomization once it is Ready on commit SHA."""
    found = _kustomization()
    ready = condition(found, "Ready") or {}
    done = found.get("status", {}).get("lastAppliedRevision") == _revision(sha) and ready.get("status") == "True"
    return found if done else None


def _refused(sha: str) -> dict[str, Any] | None:
    """The Kustomization once its attempt at SHA failed (Ready False)."""
    found = _kustomization()
    ready = condition(found, "Ready") or {}
    done = found.get("status", {}).get("lastAttemptedRevision") == _revision(sha) and ready.get("status") == "False"
    return found if done else None


def _apiserver_applies() -> tuple[float, float]:
    """The API server's own count of server-side applies to InferenceServices: (real, dry run)."""
    text = kubectl("get", "--raw", "/metrics", timeout=60)
    real = dry = 0.0
    for sample in promtext.select(text, "apiserver_request_total"):
        labels = sample.labels
        if labels.get("verb") == "APPLY" and labels.get("resource") == contract.PLURAL and not labels.get("subresource"):
            if labels.get("dry_run"):
                dry += sample.value
            else:
                real += sample.value
    return real, dry


def _check(command: str, objects: list[dict[str, Any]], *args: str) -> list[dict[str, str]]:
    """gitops-check (e2e/build/gitops-check): kstatus or Argo CD's Lua VM on OBJECTS."""
    binary = _gitops()["check"]
    done = subprocess.run([binary, command, *args], input=json.dumps(objects), capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    return list(json.loads(done.stdout))


def _argo_script(tmp: Path) -> Path:
    """The health check the chart's README ships, as the resource.customizations block's value."""
    text = CHART_README.read_text()
    block = re.search(r"```yaml\n(resource\.customizations\.health\.tensorfleet\.dev_InferenceService: \|\n.*?)```",
                      text, flags=re.DOTALL)
    assert block, f"no resource.customizations block in {CHART_README}"
    (value,) = yaml.safe_load(block.group(1)).values()
    script = tmp / "health.lua"
    script.write_text(value)
    return script


def _unfittable(doc: dict[str, Any]) -> dict[str, Any]:
    """DOC serving a model that does not fit its GPUs (405B parameters on L4s)."""
    bad = json.loads(json.dumps(doc))
    bad["spec"]["model"] = {"name": "meta-llama/Llama-3.1-405B-Instruct", "servedName": "llama-405b"}
    bad["spec"]["accelerator"] = {"type": "L4"}
    bad["spec"]["engine"].pop("kind", None)
    return bad


def _webhook_refusal(doc: dict[str, Any]) -> str:
    """The webhook's own one-line reason for refusing DOC, as `kubectl apply` shows it."""
    said = kubectl_result("apply", "--dry-run=server", "-f", "-", stdin=yaml.safe_dump(doc)).stderr.strip()
    reason = said.split("denied the request: ", 1)[-1]
    assert "denied the request" in said and "\n" not in reason, said
    return reason


# --- the flow: one team's history in one folder ---------------------------------------------------------------


class Flow:
    namespace: str
    repo: Repo
    name: str
    doc: dict[str, Any]
    sha: str


@pytest.fixture(scope="module")
def flow(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Flow]:
    """The namespace and the repository folder the flow tests share; at the end the folder goes from Git, Flux
    prunes what it applied, and the namespace is deleted."""
    found = _gitops()
    state = Flow()
    state.namespace = new_namespace("gitops")
    state.repo = Repo(found["repo"], found["path"], tmp_path_factory.mktemp("gitops") / "repo")
    try:
        yield state
    finally:
        files = {str(p.relative_to(state.repo.work / state.repo.path)): None
                 for p in (state.repo.work / state.repo.path / state.namespace).glob("*.yaml")}
        if files:
            sha = state.repo.commit(files, f"{state.namespace}: done")
            _reconcile_now()
            eventually("the Kustomization Ready without the flow's folder", lambda: _applied(sha), timeout=TIMEOUT)
        delete_namespace_later(state.namespace)


def test_01_a_commit_deploys_and_the_kustomization_is_ready_only_once_the_service_is(flow: Flow) -> None:
    doc = example("simulator-cpu.yaml", flow.namespace, replicas=2, autoscaling=None,
                  parallelism={"tensor": 1, "pipeline": 1})
    flow.name, flow.doc = doc["metadata"]["name"], doc
    flow.sha = flow.repo.commit({f"{flow.namespace}/{flow.name}.yaml": doc}, f"{flow.namespace}: deploy {flow.name}")
    _reconcile_now()
    started = time.monotonic()
    seen: list[tuple[str | None, str | None]] = []  # (the Kustomization's Ready at our commit, the service's Ready)

    def applied() -> dict[str, Any] | None:
        found = _kustomization()
        if found.get("status", {}).get("lastAttemptedRevision") == _revision(flow.sha):
            seen.append(((condition(found, "Ready") or {}).get("status"),
                         (condition(isvc(flow.name, flow.namespace), "Ready") or {}).get("status")))
        return _applied(flow.sha)
    kustomization = eventually("the Kustomization Ready at the commit", applied, timeout=TIMEOUT)
    took = time.monotonic() - started
    obj = isvc(flow.name, flow.namespace)
    assert obj is not None and (condition(obj, "Ready") or {}).get("status") == "True"
    assert obj["status"]["readyReplicas"] == 2 and obj["status"]["observedGeneration"] == obj["metadata"]["generation"]
    # Flux waited on the service's health: while the service was not Ready, neither was the Kustomization.
    assert all(k != "True" for k, s in seen if s != "True"), seen
    assert any(k != "True" for k, _ in seen), f"never saw the Kustomization wait for the service: {seen}"
    since = {c: (condition(o, "Ready") or {})["lastTransitionTime"] for c, o in (("k", kustomization), ("s", obj))}
    assert since["k"] >= since["s"], since
    assert took < TIMEOUT
    # Flux's own labels on the object it applied; the operator's children are the operator's, not Flux's.
    labels = obj["metadata"].get("labels") or {}
    assert labels.get("kustomize.toolkit.fluxcd.io/name") == APPS, labels
    print(f"\nthe Kustomization was Ready {took:.1f}s after the push")


def test_02_an_image_commit_rolls_out_with_the_kustomization_in_progress_and_no_failed_request(flow: Flow) -> None:
    url = router_url(flow.name, flow.namespace)
    model = flow.doc["spec"]["model"]["servedName"]
    flow.doc["spec"]["engine"]["image"] = NEXT_IMAGE
    with Requests(url, model) as load:
        # The router may still be finding the engines the Kustomization's health check saw Ready: the rollout's
        # requests are those from the commit on, once three in a row were answered.
        eventually("three answers in a row through the router", lambda: load.codes[-3:] == [200] * 3, timeout=120)
        first = len(load.codes)
        flow.sha = flow.repo.commit({f"{flow.namespace}/{flow.name}.yaml": flow.doc}, f"{flow.namespace}: new image")
        _reconcile_now()
        states: list[str | None] = []

        def rolled() -> dict[str, Any] | None:
            # One read of the Kustomization for both what is recorded and the verdict: a second read could see it
            # turn Ready where the recorded states never show it.
            found = _kustomization()
            ready = (condition(found, "Ready") or {}).get("status")
            if found.get("status", {}).get("lastAttemptedRevision") == _revision(flow.sha):
                states.append(ready)
            pods = engine_pods(flow.name, flow.namespace)
            done = pods and all(p["spec"]["containers"][0]["image"] == NEXT_IMAGE for p in pods)
            applied = found.get("status", {}).get("lastAppliedRevision") == _revision(flow.sha) and ready == "True"
            return found if done and applied else None
        eventually("the rollout done and the Kustomization Ready at the commit", rolled, timeout=TIMEOUT)
        sent = len(load.codes)
        eventually("a few more requests after the rollout", lambda: len(load.codes) >= sent + 3, timeout=60)
    during = load.codes[first:]
    failed = [code for code in during if code != 200]
    assert not failed, f"{len(failed)} of {len(during)} requests failed during the rollout: {failed[:10]}"
    assert "True" in states and any(s != "True" for s in states), \
        f"the Kustomization did not wait for the rollout (Ready at our commit, in order: {states})"
    obj = isvc(flow.name, flow.namespace)
    assert obj is not None and obj["status"]["updatedReplicas"] == 2
    print(f"\n{len(during)} requests through the router during the rollout, none failed")


def test_03_a_commit_the_webhook_refuses_fails_the_kustomization_with_its_reason_and_a_revert_heals(
        flow: Flow) -> None:
    good, generation = flow.doc, (isvc(flow.name, flow.namespace) or {})["metadata"]["generation"]
    bad = _unfittable(good)
    reason = _webhook_refusal(bad)
    sha = flow.repo.commit({f"{flow.namespace}/{flow.name}.yaml": bad}, f"{flow.namespace}: a model that cannot fit")
    _reconcile_now()
    refused = eventually("the Kustomization Ready=False at the refused commit", lambda: _refused(sha), timeout=TIMEOUT)
    message = (condition(refused, "Ready") or {}).get("message", "")
    assert reason in message, (reason, message)
    assert f"{contract.KIND}/{flow.namespace}/{flow.name}" in message, message
    # The last good revision keeps serving: nothing changed on the object, its router answers.
    obj = isvc(flow.name, flow.namespace)
    assert obj is not None and obj["metadata"]["generation"] == generation
    assert (condition(obj, "Ready") or {}).get("status") == "True"
    assert refused["status"]["lastAppliedRevision"] == _revision(flow.sha)
    with Requests(router_url(flow.name, flow.namespace), good["spec"]["model"]["servedName"], limit=3) as load:
        eventually("3 answers", lambda: len(load.codes) >= 3, timeout=60)
    assert load.codes[:3] == [200, 200, 200], load.codes
    flow.sha = flow.repo.commit({f"{flow.namespace}/{flow.name}.yaml": good}, f"{flow.namespace}: revert")
    _reconcile_now()
    eventually("the Kustomization Ready again at the revert", lambda: _applied(flow.sha), timeout=TIMEOUT)


def test_04_an_autoscaled_service_without_replicas_in_git_is_scaled_by_the_hpa_and_flux_writes_nothing(
        flow: Flow) -> None:
    """spec.replicas left out of Git (the CRD defaults it to 1) with autoscaling.minReplicas 2: the real HPA
    scales it to 2 through /scale, and Flux's drift detection then finds nothing to apply: for 3 intervals the
    API server counts dry-run applies to InferenceServices (Flux checking) and no real one."""
    doc = example("simulator-cpu.yaml", flow.namespace, parallelism={"tensor": 1, "pipeline": 1},
                  autoscaling={"minReplicas": 2, "maxReplicas": 3, "targetPendingRequests": 2})
    doc["metadata"]["name"] = name = "autoscaled"
    doc["spec"].pop("replicas", None)
    sha = flow.repo.commit({f"{flow.namespace}/{name}.yaml": doc}, f"{flow.namespace}: autoscaled {name}")
    _reconcile_now()
    eventually("the Kustomization Ready at the commit", lambda: _applied(sha), timeout=TIMEOUT)

    def scaled() -> dict[str, Any] | None:
        obj = isvc(name, flow.namespace) or {}
        return obj if obj.get("spec", {}).get("replicas") == 2 and obj["status"].get("readyReplicas") == 2 else None
    eventually("the HPA to scale it to minReplicas", scaled, timeout=TIMEOUT)
    # Flux's apply does not own spec.replicas (the HPA's /scale writes it), so it never takes it back.
    fields = json.loads(kubectl("get", contract.PLURAL, name, "-n", flow.namespace, "-o", "json",
                                "--show-managed-fields"))["metadata"]["managedFields"]
    owners = {f["manager"] for f in fields if "f:replicas" in ((f.get("fieldsV1") or {}).get("f:spec") or {})}
    assert "kustomize-controller" not in owners, owners
    hpa = get("horizontalpodautoscaler", contract.hpa_name(name), flow.namespace)
    assert hpa is not None and hpa["status"].get("desiredReplicas") == 2
    before, reconciled = _apiserver_applies(), _kustomization()["status"].get("lastHandledReconcileAt")
    _reconcile_now()
    time.sleep(3 * INTERVAL_S + 2)
    after = _apiserver_applies()
    assert after[0] == before[0], f"Flux wrote the InferenceServices {after[0] - before[0]:.0f} times"
    assert after[1] >= before[1] + 3, f"Flux checked only {after[1] - before[1]:.0f} times in 3 intervals"
    assert _kustomization()["status"].get("lastHandledReconcileAt") != reconciled
    now = isvc(name, flow.namespace) or {}
    assert now["spec"].get("replicas") == 2, "the HPA's replicas kept"
    assert (condition(_kustomization(), "Ready") or {}).get("status") == "True"


def test_05_removing_a_file_prunes_that_service_and_all_it_owns_and_nothing_else(flow: Flow) -> None:
    kubectl("create", "configmap", "not-in-git", "-n", flow.namespace, "--from-literal=a=b")
    name = "autoscaled"
    owned = {kind: [o["metadata"]["name"] for o in items(kind, flow.namespace, f"{contract.LABEL_INFERENCE_SERVICE}={name}")]
             for kind in ("statefulsets", "deployments", "services", "horizontalpodautoscalers")}
    assert owned["statefulsets"] and owned["deployments"], owned
    kept = flow.name
    sha = flow.repo.commit({f"{flow.namespace}/{name}.yaml": None}, f"{flow.namespace}: retire {name}")
    _reconcile_now()
    eventually("the Kustomization Ready at the commit", lambda: _applied(sha), timeout=TIMEOUT)
    eventually(f"{name} pruned", lambda: isvc(name, flow.namespace) is None, timeout=TIMEOUT)

    def gone() -> bool:
        return not any(get(kind, child, flow.namespace) for kind, children in owned.items() for child in children)
    eventually(f"everything {name} owned collected", gone, timeout=TIMEOUT)
    assert wait_ready(kept, flow.namespace), "the other service stays"
    assert get("configmap", "not-in-git", flow.namespace) is not None, "what Flux did not apply stays"


# --- the chart itself through Flux: a HelmRelease takes over the running release and upgrades it --------------


def _release(name: str = RELEASE, namespace: str = SYSTEM_NAMESPACE) -> dict[str, Any]:
    """Release NAME's newest record as Helm stores it (a Secret per revision: base64 of gzipped JSON)."""
    found = items("secrets", namespace, f"owner=helm,name={name}")
    assert found, f"no Helm release {name} in {namespace}"
    newest = max(found, key=lambda s: int(s["metadata"]["labels"]["version"]))
    return dict(json.loads(gzip.decompress(base64.b64decode(base64.b64decode(newest["data"]["release"])))))


def _chart_version() -> str:
    found = re.search(r"^version:\s*(\S+)", (CHART / "Chart.yaml").read_text(), flags=re.MULTILINE)
    assert found, "charts/tensorfleet/Chart.yaml has no version"
    return found.group(1).strip("'\"")


def _put_chart(repo: Repo, version: str, *, column: bool) -> None:
    """This repository's chart into the Git repository's CHART_IN_GIT, as VERSION; with COLUMN, its CRD gains a
    printer column (a CRD change as a new release of the chart brings one)."""
    target = repo.work / CHART_IN_GIT
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(CHART, target)
    meta = target / "Chart.yaml"
    meta.write_text(re.sub(r"^version:.*$", f"version: {version}", meta.read_text(), count=1, flags=re.MULTILINE))
    if column:
        (crd_file,) = (target / "crds").glob("*.yaml")
        crd = yaml.safe_load(crd_file.read_text())
        for version_ in crd["spec"]["versions"]:
            version_.setdefault("additionalPrinterColumns", []).append(
                {"name": "Generation", "type": "integer", "jsonPath": ".metadata.generation", "priority": 1})
        crd_file.write_text(yaml.safe_dump(crd, sort_keys=False))


def _helm_release(values: dict[str, Any], *, suspend: bool = False, name: str = RELEASE,
                  namespace: str = SYSTEM_NAMESPACE) -> dict[str, Any]:
    """The HelmRelease a platform team commits for the chart: release NAME in NAMESPACE (by default the running
    one: Flux upgrades a release it did not make), the chart from the same Git repository, CRDs created and
    replaced."""
    spec: dict[str, Any] = {
        "interval": f"{INTERVAL_S}s", "releaseName": name, "targetNamespace": namespace,
        "storageNamespace": namespace, "timeout": "3m",
        "chart": {"spec": {"chart": f"./{CHART_IN_GIT}", "interval": f"{INTERVAL_S}s",
                           "sourceRef": {"kind": "GitRepository", "name": SOURCE}}},
        "install": {"crds": "CreateReplace"}, "upgrade": {"crds": "CreateReplace"}, "values": values}
    if suspend:
        spec["suspend"] = True
    return {"apiVersion": "helm.toolkit.fluxcd.io/v2", "kind": "HelmRelease",
            "metadata": {"name": name, "namespace": FLUX_NAMESPACE}, "spec": spec}


def _released(chart_version: str, name: str = RELEASE) -> dict[str, Any] | None:
    """The HelmRelease NAME once it is Ready with CHART_VERSION deployed."""
    found = get(HELM_RELEASE, name, FLUX_NAMESPACE)
    if not found or (condition(found, "Ready") or {}).get("status") != "True":
        return None
    status = found.get("status", {})
    latest = (status.get("history") or [{}])[0]
    current = status.get("observedGeneration") == found["metadata"]["generation"]
    return found if current and latest.get("chartVersion") == chart_version and latest.get("status") == "deployed" \
        else None


def _columns() -> list[str]:
    crd = json.loads(kubectl("get", CRD, "-o", "json"))
    return [c["name"] for v in crd["spec"]["versions"] for c in v.get("additionalPrinterColumns") or []]


def _ca_bundle() -> str:
    hook = json.loads(kubectl("get", "validatingwebhookconfigurations", "-o", "json",
                              "-l", f"app.kubernetes.io/instance={RELEASE}"))["items"]
    assert len(hook) == 1, [h["metadata"]["name"] for h in hook]
    return str(hook[0]["webhooks"][0]["clientConfig"].get("caBundle", ""))


def test_06_a_helmrelease_takes_over_the_chart_upgrades_it_crd_included_and_hands_it_back(flow: Flow) -> None:
    """The chart `e2e/cluster up` installed with `helm install`, taken over by a HelmRelease committed with the
    chart (helm-controller upgrades a release it did not make), upgraded by a commit whose CRD changed (upgrade.crds
    CreateReplace), with the flow's service serving through it all, then handed back: suspended, then removed from
    Git, which leaves the release installed."""
    installed = _release()
    values, start = installed["config"], installed["version"]  # what `helm install` was given, and its revision
    obj = isvc(flow.name, flow.namespace)
    assert obj is not None and (condition(obj, "Ready") or {}).get("status") == "True"
    uid, generation, bundle = obj["metadata"]["uid"], obj["metadata"]["generation"], _ca_bundle()
    base = _chart_version()
    file = f"{FLUX_NAMESPACE}/{RELEASE}-chart.yaml"
    handed_back = False
    try:
        # 1. Taken over: the chart as it is, at the running release's name and namespace.
        _put_chart(flow.repo, base, column=False)
        sha = flow.repo.commit({file: _helm_release(values)}, "the chart by Flux")
        _reconcile_now()
        started = time.monotonic()
        eventually("the Kustomization Ready with the HelmRelease", lambda: _applied(sha), timeout=TIMEOUT)
        eventually(f"the HelmRelease Ready with chart {base}", lambda: _released(base), timeout=TIMEOUT)
        took = {"taken over": time.monotonic() - started}
        taken = _release()
        assert (taken["version"], taken["info"]["status"]) == (start + 1, "deployed"), taken["info"]
        assert "Generation" not in _columns()
        # 2. A new chart release whose CRD changed, with requests through the flow's service all along.
        upgraded = f"{base}-e2e.1"
        with Requests(router_url(flow.name, flow.namespace), flow.doc["spec"]["model"]["servedName"]) as load:
            eventually("three answers in a row through the router", lambda: load.codes[-3:] == [200] * 3, timeout=120)
            first = len(load.codes)
            _put_chart(flow.repo, upgraded, column=True)
            flow.repo.commit({}, f"the chart {upgraded}: a CRD printer column")
            _reconcile_now()
            started = time.monotonic()
            eventually(f"the HelmRelease Ready with chart {upgraded}", lambda: _released(upgraded), timeout=TIMEOUT)
            took["upgraded"] = time.monotonic() - started
            sent = len(load.codes)
            eventually("a few more requests after the upgrade", lambda: len(load.codes) >= sent + 3, timeout=60)
        during = load.codes[first:]
        assert during and all(code == 200 for code in during), f"requests during the upgrade: {during}"
        assert "Generation" in _columns(), "upgrade.crds CreateReplace did not upgrade the CRD"
        record = _release()
        assert (record["version"], record["chart"]["metadata"]["version"]) == (start + 2, upgraded)
        # The InferenceService survived the CRD's replacement untouched; Helm kept the webhook's CA (its lookup of
        # the Secret, which helm-controller runs against the cluster); the webhook still refuses.
        obj = isvc(flow.name, flow.namespace)
        assert obj is not None and (obj["metadata"]["uid"], obj["metadata"]["generation"]) == (uid, generation)
        assert (condition(obj, "Ready") or {}).get("status") == "True"
        assert _ca_bundle() == bundle, "the upgrade made a new webhook CA"
        _webhook_refusal(_unfittable(flow.doc))
        # 3. Back to this repository's chart (its CRD again), then handed back: suspended first, so that removing
        # the HelmRelease leaves the release installed (helm-controller uninstalls only what is not suspended).
        restored = f"{base}-e2e.2"
        _put_chart(flow.repo, restored, column=False)
        flow.repo.commit({}, f"the chart {restored}: this repository's CRD")
        _reconcile_now()
        eventually(f"the HelmRelease Ready with chart {restored}", lambda: _released(restored), timeout=TIMEOUT)
        assert "Generation" not in _columns()
        sha = flow.repo.commit({file: _helm_release(values, suspend=True)}, "the chart: suspended")
        _reconcile_now()
        eventually("the Kustomization Ready with the HelmRelease suspended", lambda: _applied(sha), timeout=TIMEOUT)
        handed_back = True
    finally:
        if not handed_back and get(HELM_RELEASE, RELEASE, FLUX_NAMESPACE) is not None:
            # Whatever failed above, the release must outlive the HelmRelease: later suites run on it.
            kubectl("patch", HELM_RELEASE, RELEASE, "-n", FLUX_NAMESPACE, "--type=merge", "-p", '{"spec":{"suspend":true}}')
        shutil.rmtree(flow.repo.work / CHART_IN_GIT, ignore_errors=True)
        sha = flow.repo.commit({file: None}, "the chart: back to helm")
        _reconcile_now()
        eventually("the Kustomization Ready without the HelmRelease", lambda: _applied(sha), timeout=TIMEOUT)
        eventually("the HelmRelease gone", lambda: get(HELM_RELEASE, RELEASE, FLUX_NAMESPACE) is None, timeout=TIMEOUT)
    kept = _release()
    assert (kept["version"], kept["info"]["status"]) == (start + 3, "deployed"), kept["info"]
    assert wait_ready(flow.name, flow.namespace)
    _webhook_refusal(_unfittable(flow.doc))
    print(f"\nthe HelmRelease took the release over {took['taken over']:.1f}s after the push and upgraded it (CRD "
          f"included) {took['upgraded']:.1f}s after the next; {len(during)} requests meanwhile, none failed")


def test_07_a_helmrelease_installs_a_namespaced_copy_and_its_removal_uninstalls_it_but_no_crd_or_service(
        flow: Flow) -> None:
    """A second, namespaced install of the chart (watchNamespaces, webhook off: one webhook per cluster) made by
    helm-controller's install action and judged healthy by its wait; removing its HelmRelease from Git uninstalls
    every object it made, and leaves the CRD (Helm never deletes crds/) and every InferenceService."""
    namespace, name = new_namespace("gitops-chart"), f"{RELEASE}-team"
    values = {"watchNamespaces": [namespace], "webhook": {"enabled": False}, "operator": {"replicas": 0}}
    file = f"{FLUX_NAMESPACE}/{name}-chart.yaml"
    crd_uid = json.loads(kubectl("get", CRD, "-o", "json"))["metadata"]["uid"]
    main_release = _release()["version"]
    base = _chart_version()
    try:
        _put_chart(flow.repo, base, column=False)
        sha = flow.repo.commit({file: _helm_release(values, name=name, namespace=namespace)}, f"the chart as {name}")
        _reconcile_now()
        eventually("the Kustomization Ready with the HelmRelease", lambda: _applied(sha), timeout=TIMEOUT)
        eventually(f"the HelmRelease {name} Ready", lambda: _released(base, name), timeout=TIMEOUT)
        installed = _release(name, namespace)
        assert (installed["version"], installed["info"]["status"]) == (1, "deployed"), installed["info"]
        made = _objects_of(name, namespace)
        assert {"Deployment", "ServiceAccount", "ClusterRole"} <= {kind for kind, _ in made}, made
    finally:
        shutil.rmtree(flow.repo.work / CHART_IN_GIT, ignore_errors=True)
        sha = flow.repo.commit({file: None}, f"the chart as {name}: removed")
        _reconcile_now()
        eventually("the Kustomization Ready without the HelmRelease", lambda: _applied(sha), timeout=TIMEOUT)
        eventually("the HelmRelease gone", lambda: get(HELM_RELEASE, name, FLUX_NAMESPACE) is None, timeout=TIMEOUT)
    eventually(f"every object of {name} uninstalled", lambda: not _objects_of(name, namespace), timeout=TIMEOUT)
    assert not items("secrets", namespace, f"owner=helm,name={name}"), "the release's records stay"
    assert json.loads(kubectl("get", CRD, "-o", "json"))["metadata"]["uid"] == crd_uid, "the CRD was replaced anew"
    assert wait_ready(flow.name, flow.namespace)
    assert _release()["version"] == main_release, "the other release was touched"
    delete_namespace_later(namespace)


def _objects_of(release: str, namespace: str) -> list[tuple[str, str]]:
    """(kind, name) of what release RELEASE made: its objects in NAMESPACE and its cluster-scoped ones."""
    selector = f"app.kubernetes.io/instance={release}"
    found = [*items("deployments,services,serviceaccounts,configmaps,secrets,roles,rolebindings", namespace, selector),
             *items("clusterroles,clusterrolebindings", None, selector)]
    return [(o["kind"], o["metadata"]["name"]) for o in found]


# --- kstatus and Argo CD's health check on real objects in each state ------------------------------------------


def test_kstatus_and_the_argo_cd_health_check_judge_each_state_of_a_real_service(tmp_path: Path) -> None:
    """One service taken through its states by the real operator (kubectl, no Flux needed): starting, Ready,
    a stuck cause (a crash loop as the kubelet reports it, from e2e/kwok-stages.yaml), and parked at
    spec.replicas 0. Each object as the API server returns it goes to kstatus's Compute and to the chart's Argo
    CD health script in gopher-lua."""
    namespace = new_namespace("gitops-health")
    try:
        _health_states(namespace, tmp_path)
    finally:
        delete_namespace_later(namespace)


def _health_states(namespace: str, tmp: Path) -> None:
    doc = example("simulator-cpu.yaml", namespace, replicas=1, autoscaling=None,
                  parallelism={"tensor": 1, "pipeline": 1})
    name = doc["metadata"]["name"]
    kubectl("apply", "-f", "-", stdin=yaml.safe_dump(doc))
    captured: dict[str, dict[str, Any]] = {}

    def state(label: str, probe: Any) -> None:
        captured[label] = eventually(f"{namespace}/{name} {label}", lambda: _when(name, namespace, probe),
                                     timeout=TIMEOUT, every=0.2)

    state("starting", lambda c: c.get("Reconciling") == "True" and c.get("Ready") == "False")
    state("ready", lambda c: c.get("Ready") == "True" and c.get("Reconciling") == "False")
    doc["spec"]["engine"]["env"] = [{"name": "E2E_KWOK_FAULT", "value": "CrashLoopBackOff"}]
    kubectl("apply", "-f", "-", stdin=yaml.safe_dump(doc))
    state("stuck", lambda c: c.get("Stalled") == "True")
    doc["spec"]["engine"].pop("env")
    doc["spec"]["replicas"] = 0
    kubectl("apply", "-f", "-", stdin=yaml.safe_dump(doc))
    state("parked", lambda c: c.get("Ready") == "True" and c.get("Reconciling") == "False"
          and not engine_pods(name, namespace))
    generation_ahead = json.loads(json.dumps(captured["ready"]))
    generation_ahead["metadata"]["generation"] += 1  # the spec changed and the operator has not seen it yet
    captured["unobserved"] = generation_ahead
    labels = list(captured)
    objects = [captured[label] for label in labels]
    kstatus = dict(zip(labels, _check("kstatus", objects), strict=True))
    argo = dict(zip(labels, _check("argo-health", objects, str(_argo_script(tmp))), strict=True))
    expected = {"starting": ("InProgress", "Progressing"), "ready": ("Current", "Healthy"),
                "stuck": ("Failed", "Degraded"), "parked": ("Current", "Suspended"),
                "unobserved": ("InProgress", "Progressing")}
    assert {label: (kstatus[label]["status"], argo[label]["status"]) for label in labels} == expected, (kstatus, argo)
    stuck = condition(captured["stuck"], "Stalled") or {}
    assert kstatus["stuck"]["message"] == argo["stuck"]["message"] == stuck["message"]
    assert "CrashLoopBackOff" in stuck["message"] and stuck["reason"] == "CrashLoopBackOff"
    for label in labels:
        print(f"\n{label}: kstatus {kstatus[label]['status']} ({kstatus[label]['message']}); "
              f"Argo CD {argo[label]['status']} ({argo[label]['message']})", end="")


def _when(name: str, namespace: str, probe: Any) -> dict[str, Any] | None:
    obj = isvc(name, namespace)
    if not obj or obj.get("status", {}).get("observedGeneration") != obj["metadata"]["generation"]:
        return None
    conditions = {c["type"]: c["status"] for c in obj["status"].get("conditions") or []}
    return obj if probe(conditions) else None
