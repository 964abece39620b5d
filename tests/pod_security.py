"""The Pod Security Standards' `restricted` profile, as a check on pod specs.

Written from the documented rules (https://kubernetes.io/docs/concepts/security/pod-security-standards/,
version "latest"), baseline's included, for Linux pods. `violations` returns
one line per broken rule, naming the field; an empty list means the pod
would be admitted into a namespace labelled
`pod-security.kubernetes.io/enforce=restricted`. The e2e suite checks the
same against the real API server's PodSecurity admission.
"""

from __future__ import annotations

from typing import Any

# Baseline: capabilities a container may add.
BASELINE_CAPABILITIES = frozenset({
    "AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD", "NET_BIND_SERVICE",
    "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT",
})
# Restricted: the only capability a container may add (after dropping ALL).
RESTRICTED_CAPABILITIES = frozenset({"NET_BIND_SERVICE"})
# Restricted: the volume types allowed.
RESTRICTED_VOLUMES = frozenset({
    "configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected", "secret",
})
SAFE_SYSCTLS = frozenset({
    "kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
    "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
    "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
    "net.ipv4.tcp_keepalive_probes",
})
SELINUX_TYPES = frozenset({"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"})
SECCOMP_TYPES = frozenset({"RuntimeDefault", "Localhost"})
APPARMOR_TYPES = frozenset({"RuntimeDefault", "Localhost"})
APPARMOR_ANNOTATION = "container.apparmor.security.beta.kubernetes.io/"


def _containers(pod: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for field in ("initContainers", "containers", "ephemeralContainers"):
        out += [(f"spec.{field}[{c.get('name', i)}]", c) for i, c in enumerate(pod.get(field) or [])]
    return out


def violations(pod: dict[str, Any], annotations: dict[str, str] | None = None) -> list[str]:
    """What keeps a pod spec (a PodSpec, e.g. a template's .spec) out of the restricted profile."""
    found: list[str] = []
    pod_sc = pod.get("securityContext") or {}
    containers = _containers(pod)

    # --- baseline ------------------------------------------------------------
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(field):
            found.append(f"spec.{field} must be unset or false")
    if (pod_sc.get("windowsOptions") or {}).get("hostProcess"):
        found.append("spec.securityContext.windowsOptions.hostProcess must be unset or false")
    for sysctl in pod_sc.get("sysctls") or []:
        if sysctl.get("name") not in SAFE_SYSCTLS:
            found.append(f"spec.securityContext.sysctls: {sysctl.get('name')} is not a safe sysctl")
    for where, sc in [("spec.securityContext", pod_sc), *((f"{p}.securityContext", c.get("securityContext") or {})
                                                         for p, c in containers)]:
        selinux = sc.get("seLinuxOptions") or {}
        if selinux.get("type", "") not in SELINUX_TYPES:
            found.append(f"{where}.seLinuxOptions.type {selinux.get('type')!r} is not allowed")
        if selinux.get("user") or selinux.get("role"):
            found.append(f"{where}.seLinuxOptions.user and .role must be unset")
        apparmor = sc.get("appArmorProfile")
        if apparmor is not None and apparmor.get("type") not in APPARMOR_TYPES:
            found.append(f"{where}.appArmorProfile.type must be RuntimeDefault or Localhost")
        seccomp = sc.get("seccompProfile")
        if seccomp is not None and seccomp.get("type") not in SECCOMP_TYPES:
            found.append(f"{where}.seccompProfile.type must be RuntimeDefault or Localhost, not {seccomp.get('type')}")
    for key, value in (annotations or {}).items():
        if key.startswith(APPARMOR_ANNOTATION) and not (value == "runtime/default" or value.startswith("localhost/")):
            found.append(f"annotation {key}={value} is not runtime/default or localhost/*")
    for volume in pod.get("volumes") or []:
        kinds = set(volume) - {"name"}
        if "hostPath" in kinds:
            found.append(f"spec.volumes[{volume.get('name')}]: hostPath volumes are not allowed")
        elif not kinds <= RESTRICTED_VOLUMES:
            found.append(f"spec.volumes[{volume.get('name')}]: {', '.join(sorted(kinds))} is not an allowed volume type")

    # --- restricted, and baseline's per-container rules -------------------------
    pod_non_root = pod_sc.get("runAsNonRoot") is True
    if pod_sc.get("runAsUser") == 0:
        found.append("spec.securityContext.runAsUser must not be 0")
    pod_seccomp = (pod_sc.get("seccompProfile") or {}).get("type") in SECCOMP_TYPES
    for where, container in containers:
        sc = container.get("securityContext") or {}
        if sc.get("privileged"):
            found.append(f"{where}.securityContext.privileged must be unset or false")
        if (sc.get("windowsOptions") or {}).get("hostProcess"):
            found.append(f"{where}.securityContext.windowsOptions.hostProcess must be unset or false")
        if sc.get("procMount", "Default") != "Default":
            found.append(f"{where}.securityContext.procMount must be Default")
        for port in container.get("ports") or []:
            if port.get("hostPort"):
                found.append(f"{where}.ports[{port.get('name', port.get('containerPort'))}].hostPort must be unset or 0")
        if sc.get("allowPrivilegeEscalation") is not False:
            found.append(f"{where}.securityContext.allowPrivilegeEscalation must be false")
        non_root = sc.get("runAsNonRoot")
        if non_root is False or (non_root is None and not pod_non_root):
            found.append(f"{where}.securityContext.runAsNonRoot must be true (here or in spec.securityContext)")
        if sc.get("runAsUser") == 0:
            found.append(f"{where}.securityContext.runAsUser must not be 0")
        if not pod_seccomp and (sc.get("seccompProfile") or {}).get("type") not in SECCOMP_TYPES:
            found.append(f"{where}.securityContext.seccompProfile.type must be RuntimeDefault or Localhost "
                         "(here or in spec.securityContext)")
        capabilities = sc.get("capabilities") or {}
        if "ALL" not in (capabilities.get("drop") or []):
            found.append(f"{where}.securityContext.capabilities.drop must include ALL")
        added = set(capabilities.get("add") or [])
        if added - RESTRICTED_CAPABILITIES:
            found.append(f"{where}.securityContext.capabilities.add: {', '.join(sorted(added - RESTRICTED_CAPABILITIES))} "
                         "(only NET_BIND_SERVICE may be added)")
    return found


def pod_templates(objects: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any], dict[str, str]]]:
    """(kind/name, pod spec, pod annotations) of every pod template among rendered objects."""
    out = []
    for obj in objects:
        template = (obj.get("spec") or {}).get("template")
        if isinstance(template, dict) and "spec" in template:
            out.append((f"{obj['kind']}/{obj['metadata']['name']}", template["spec"],
                        (template.get("metadata") or {}).get("annotations") or {}))
    return out
