"""The e2e pod runner's volumes: the files of a pod's secret, configMap, downwardAPI and projected volumes
(`volume_files`, with the pod-bound ServiceAccount tokens of `TokenSource`), written as the kubelet's AtomicWriter
writes them (`write_atomically`: a `..data` link swapped in one rename), and the error for one that cannot be set
up (`VolumeError`). Part of the pod runner, e2e/podrunner.py; how pods see them:
e2e/README.md#real-processes-for-control-plane-pods.
"""

from __future__ import annotations

import contextlib
import shutil
import time
from pathlib import Path
from typing import Any

from podrunner_api import Api, ApiError
from podrunner_spec import Lookup, field_value, resource_value

Files = dict[str, tuple[bytes, int]]   # relative path -> (content, mode)


def write_atomically(directory: Path, files: Files) -> None:
    """The kubelet's AtomicWriter layout: a timestamped folder, `..data` pointing at it, a link per entry."""
    directory.mkdir(parents=True, exist_ok=True)
    stamp = directory / f"..{time.strftime('%Y_%m_%d_%H_%M_%S')}.{time.monotonic_ns()}"
    stamp.mkdir()
    for relative, (content, mode) in files.items():
        target = stamp / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(content)
        target.chmod(mode)
    temporary = directory / "..data_tmp"
    with contextlib.suppress(FileNotFoundError):
        temporary.unlink()
    temporary.symlink_to(stamp.name)
    temporary.replace(directory / "..data")
    tops = {Path(relative).parts[0] for relative in files}
    for entry in directory.iterdir():
        if entry.name.startswith(".."):
            if entry.name not in ("..data", stamp.name) and entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
        elif entry.name not in tops and entry.is_symlink():
            entry.unlink()
    for top in tops:
        link = directory / top
        if not link.is_symlink() and not link.exists():
            link.symlink_to(f"..data/{top}")


class VolumeError(Exception):
    """A volume that cannot be set up (the kubelet's FailedMount): the container waits."""


class TokenSource:
    """TokenRequest tokens of the pod's ServiceAccount, bound to the pod, renewed at 80% of their life."""

    def __init__(self, api: Api, pod: dict[str, Any]) -> None:
        self.api, self.pod = api, pod
        self.cache: dict[tuple[str, int], tuple[str, float, float]] = {}

    def token(self, audience: str, seconds: int) -> str:
        key = (audience, seconds)
        cached = self.cache.get(key)
        if cached and time.monotonic() < cached[1] + 0.8 * cached[2]:
            return cached[0]
        meta, spec = self.pod["metadata"], self.pod["spec"]
        account = spec.get("serviceAccountName") or "default"
        body = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": {
            "audiences": [audience] if audience else [],
            "expirationSeconds": seconds,
            "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": meta["name"], "uid": meta["uid"]}}}
        try:
            answer = self.api.call("POST", f"/api/v1/namespaces/{meta['namespace']}/serviceaccounts/{account}/token",
                                   body)
        except ApiError as exc:
            raise VolumeError(f"serviceaccounts/{account}/token: {exc}") from None
        token = answer["status"]["token"]
        self.cache[key] = (token, time.monotonic(), float(seconds))
        return str(token)


def _data_files(data: dict[str, str], items: list[dict[str, Any]] | None, mode: int, what: str,
                optional: bool) -> Files:
    if not items:
        return {key: (value.encode(), mode) for key, value in data.items()}
    files: Files = {}
    for item in items:
        if item["key"] not in data:
            if optional:
                continue
            raise VolumeError(f"couldn't find key {item['key']} in {what}")
        files[item["path"]] = (data[item["key"]].encode(), item.get("mode", mode))
    return files


def volume_files(pod: dict[str, Any], volume: dict[str, Any], lookup: Lookup, tokens: TokenSource,
                 allocatable: dict[str, Any]) -> Files | None:
    """The files of a secret, configMap, downwardAPI or projected volume; None for an emptyDir."""
    namespace = pod["metadata"]["namespace"]
    containers = {c["name"]: c for c in pod["spec"]["containers"]}

    def keyed(kind: str, source: dict[str, Any], name: str, mode: int) -> Files:
        data = lookup(kind, name)
        label = "Secret" if kind == "secret" else "ConfigMap"
        if data is None:
            if source.get("optional"):
                return {}
            raise VolumeError(f'{kind} "{name}" not found')
        return _data_files(data, source.get("items"), mode, f"{label} {namespace}/{name}", bool(source.get("optional")))

    def downward(items: list[dict[str, Any]], mode: int) -> Files:
        files: Files = {}
        for item in items:
            if "fieldRef" in item:
                value = field_value(pod, item["fieldRef"]["fieldPath"])
            else:
                ref = item["resourceFieldRef"]
                container = containers.get(ref.get("containerName") or "") or pod["spec"]["containers"][0]
                value = resource_value(container, ref["resource"], ref.get("divisor"), allocatable)
            files[item["path"]] = (value.encode(), item.get("mode", mode))
        return files

    if "emptyDir" in volume:
        return None
    if "secret" in volume:
        source = volume["secret"]
        return keyed("secret", source, source["secretName"], source.get("defaultMode", 0o644))
    if "configMap" in volume:
        source = volume["configMap"]
        return keyed("configmap", source, source["name"], source.get("defaultMode", 0o644))
    if "downwardAPI" in volume:
        source = volume["downwardAPI"]
        return downward(source.get("items") or [], source.get("defaultMode", 0o644))
    if "projected" in volume:
        projected = volume["projected"]
        mode = projected.get("defaultMode", 0o644)
        files: Files = {}
        for source in projected.get("sources") or []:
            if "secret" in source:
                files.update(keyed("secret", source["secret"], source["secret"]["name"], mode))
            elif "configMap" in source:
                files.update(keyed("configmap", source["configMap"], source["configMap"]["name"], mode))
            elif "downwardAPI" in source:
                files.update(downward(source["downwardAPI"].get("items") or [], mode))
            elif "serviceAccountToken" in source:
                ref = source["serviceAccountToken"]
                token = tokens.token(ref.get("audience", ""), int(ref.get("expirationSeconds", 3600)))
                files[ref["path"]] = (token.encode(), mode)
            else:
                raise VolumeError(f"volume {volume['name']}: projected source {sorted(source)} is not supported "
                                  "by the e2e pod runner")
        return files
    kinds = sorted(k for k in volume if k != "name")
    raise VolumeError(f"volume {volume['name']}: {', '.join(kinds)} volumes are not supported by the e2e pod runner")
