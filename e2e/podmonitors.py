"""PodMonitors (monitoring.coreos.com/v1) translated into the e2e cluster's Prometheus scrape configs
(e2e/monitoring.py), as prometheus-operator translates them.

`scrape_configs`: one scrape job per podMetricsEndpoint, named
`podMonitor/NAMESPACE/NAME/INDEX` as prometheus-operator names them. Every
PodMonitor in every namespace is used (like a Prometheus resource whose
podMonitorSelector and podMonitorNamespaceSelector are `{}`). Translated:
selector (matchLabels and matchExpressions, as keep/drop relabelings on the pod
labels, with the operator's own quirk that a matchLabels value is a regex),
namespaceSelector (any, matchNames, else the PodMonitor's namespace), the running
filter (filterRunning), port / portNumber / targetPort, path, interval, scrapeTimeout,
scheme, params, honorLabels, honorTimestamps, trackTimestampsStaleness,
followRedirects, enableHttp2, the target labels namespace, container, pod, job
(NAMESPACE/NAME, or the jobLabel's value), endpoint, podTargetLabels, relabelings,
metricRelabelings, and the limits (sampleLimit, targetLimit, labelLimit,
labelNameLengthLimit, labelValueLengthLimit, keepDroppedTargets, bodySizeLimit,
scrapeProtocols). Its limits: the endpoint fields that need Secrets or client
certificates (tlsConfig, authorization, basicAuth, oauth2, bearerTokenSecret) and
the proxy fields are not translated (the target is scraped without them, and the
watcher's log and `monitoring reload` name what was ignored); so are attachMetadata,
scrapeClass, selectorMechanism RoleSelector (the relabel mechanism is used), the
native-histogram settings and fallbackScrapeProtocol; there is no sharding and no
enforced namespace label; and a PodMonitor the operator would reject (an invalid
relabeling) reaches Prometheus, whose reload then fails and keeps the last config.

Only the Python standard library, like e2e/monitoring.py.
"""

from __future__ import annotations

import re
from typing import Any

UNTRANSLATED_ENDPOINT_FIELDS = ("tlsConfig", "authorization", "basicAuth", "oauth2", "bearerTokenSecret",
                                "proxyUrl", "noProxy", "proxyFromEnvironment", "proxyConnectHeader")
UNTRANSLATED_SPEC_FIELDS = ("attachMetadata", "scrapeClass", "nativeHistogramBucketLimit",
                            "nativeHistogramMinBucketFactor", "scrapeClassicHistograms",
                            "convertClassicHistogramsToNHCB", "fallbackScrapeProtocol")
SPEC_LIMITS = {"sampleLimit": "sample_limit", "targetLimit": "target_limit", "labelLimit": "label_limit",
               "labelNameLengthLimit": "label_name_length_limit",
               "labelValueLengthLimit": "label_value_length_limit",
               "keepDroppedTargets": "keep_dropped_targets", "bodySizeLimit": "body_size_limit",
               "scrapeProtocols": "scrape_protocols"}
ENDPOINT_FIELDS = {"interval": "scrape_interval", "scrapeTimeout": "scrape_timeout", "path": "metrics_path",
                   "params": "params", "scheme": "scheme", "followRedirects": "follow_redirects",
                   "enableHttp2": "enable_http2"}
ENDPOINT_FLAGS = {"honorLabels": "honor_labels", "honorTimestamps": "honor_timestamps",
                  "trackTimestampsStaleness": "track_timestamps_staleness"}
RELABEL_FIELDS = (("sourceLabels", "source_labels"), ("separator", "separator"), ("targetLabel", "target_label"),
                  ("regex", "regex"), ("modulus", "modulus"), ("replacement", "replacement"))


def sanitize(name: str) -> str:
    """A Kubernetes label name as Prometheus' service discovery spells it in a meta label."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


def relabelings(configs: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """monitoring.coreos.com RelabelConfigs -> Prometheus relabel_configs (the action lower-cased)."""
    out = []
    for config in configs or []:
        rule = {theirs: config[ours] for ours, theirs in RELABEL_FIELDS if config.get(ours) not in (None, "", [], 0)}
        if config.get("action"):
            rule["action"] = str(config["action"]).lower()
        out.append(rule)
    return out


def selector_relabelings(selector: dict[str, Any]) -> list[dict[str, Any]]:
    """A label selector as keep/drop rules on the pod's labels, the way prometheus-operator writes them."""
    rules = []
    for key in sorted(selector.get("matchLabels") or {}):
        rules.append({"action": "keep", "regex": f"({selector['matchLabels'][key]});true",
                      "source_labels": [f"__meta_kubernetes_pod_label_{sanitize(key)}",
                                        f"__meta_kubernetes_pod_labelpresent_{sanitize(key)}"]})
    for expression in selector.get("matchExpressions") or []:
        key, operator = sanitize(expression["key"]), expression["operator"]
        values = "|".join(expression.get("values") or [])
        both = [f"__meta_kubernetes_pod_label_{key}", f"__meta_kubernetes_pod_labelpresent_{key}"]
        present = [f"__meta_kubernetes_pod_labelpresent_{key}"]
        rules.append({
            "In": {"action": "keep", "source_labels": both, "regex": f"({values});true"},
            "NotIn": {"action": "drop", "source_labels": both, "regex": f"({values});true"},
            "Exists": {"action": "keep", "source_labels": present, "regex": "true"},
            "DoesNotExist": {"action": "drop", "source_labels": present, "regex": "true"},
        }[operator])
    return rules


def podmonitor_jobs(monitor: dict[str, Any], sd: dict[str, Any]) -> tuple[list[dict[str, Any]], list[str]]:
    """One PodMonitor's scrape jobs (one per podMetricsEndpoint) and what was left untranslated."""
    meta, spec = monitor["metadata"], monitor.get("spec") or {}
    namespace, name = meta["namespace"], meta["name"]
    where = f"PodMonitor {namespace}/{name}"
    warnings = [f"{where}: spec.{field} is not translated" for field in UNTRANSLATED_SPEC_FIELDS if spec.get(field)]
    if spec.get("selectorMechanism") == "RoleSelector":
        warnings.append(f"{where}: spec.selectorMechanism RoleSelector is not translated (relabeling used)")
    chosen = spec.get("namespaceSelector") or {}
    namespaces = [] if chosen.get("any") else (chosen.get("matchNames") or [namespace])
    discovery = {"role": "pod", **sd}
    if namespaces:
        discovery["namespaces"] = {"names": list(namespaces)}
    jobs = []
    for index, endpoint in enumerate(spec.get("podMetricsEndpoints") or []):
        warnings += [f"{where}: podMetricsEndpoints[{index}].{field} is not translated"
                     for field in UNTRANSLATED_ENDPOINT_FIELDS if endpoint.get(field)]
        job: dict[str, Any] = {"job_name": f"podMonitor/{namespace}/{name}/{index}"}
        job.update({theirs: endpoint[ours] for ours, theirs in ENDPOINT_FLAGS.items() if ours in endpoint})
        job["kubernetes_sd_configs"] = [discovery]
        job.update({theirs: endpoint[ours] for ours, theirs in ENDPOINT_FIELDS.items() if endpoint.get(ours)})
        rules: list[dict[str, Any]] = [{"source_labels": ["job"], "target_label": "__tmp_prometheus_job_name"}]
        if endpoint.get("filterRunning", True):
            rules.append({"action": "drop", "source_labels": ["__meta_kubernetes_pod_phase"],
                          "regex": "(Failed|Succeeded)"})
        rules += selector_relabelings(spec.get("selector") or {})
        port, number, target = endpoint.get("port"), endpoint.get("portNumber"), endpoint.get("targetPort")
        if port:
            rules.append({"action": "keep", "source_labels": ["__meta_kubernetes_pod_container_port_name"],
                          "regex": port})
        elif number:
            rules.append({"action": "keep", "source_labels": ["__meta_kubernetes_pod_container_port_number"],
                          "regex": str(number)})
        elif target not in (None, "", 0):
            by = "name" if isinstance(target, str) else "number"
            rules.append({"action": "keep", "source_labels": [f"__meta_kubernetes_pod_container_port_{by}"],
                          "regex": str(target)})
        rules += [{"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
                  {"source_labels": ["__meta_kubernetes_pod_container_name"], "target_label": "container"},
                  {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"}]
        for label in spec.get("podTargetLabels") or []:
            rules.append({"source_labels": [f"__meta_kubernetes_pod_label_{sanitize(label)}"],
                          "target_label": sanitize(label), "regex": "(.+)", "replacement": "${1}"})
        rules.append({"target_label": "job", "replacement": f"{namespace}/{name}"})
        if spec.get("jobLabel"):
            rules.append({"source_labels": [f"__meta_kubernetes_pod_label_{sanitize(spec['jobLabel'])}"],
                          "target_label": "job", "regex": "(.+)", "replacement": "${1}"})
        if port or isinstance(target, str) and target:
            rules.append({"target_label": "endpoint", "replacement": port or str(target)})
        rules += relabelings(endpoint.get("relabelings"))
        job["relabel_configs"] = rules
        job.update({theirs: spec[ours] for ours, theirs in SPEC_LIMITS.items() if spec.get(ours)})
        metric_rules = relabelings(endpoint.get("metricRelabelings"))
        if metric_rules:
            job["metric_relabel_configs"] = metric_rules
        jobs.append(job)
    return jobs, warnings


def scrape_configs(monitors: list[dict[str, Any]], sd: dict[str, Any]) -> tuple[list[dict[str, Any]], list[str]]:
    """Every PodMonitor's scrape jobs, in a stable order (namespace, name), and the warnings."""
    jobs, warnings = [], []
    for monitor in sorted(monitors, key=lambda m: (m["metadata"]["namespace"], m["metadata"]["name"])):
        found, said = podmonitor_jobs(monitor, sd)
        jobs += found
        warnings += said
    return jobs, warnings


def prometheus_config(monitors: list[dict[str, Any]], sd: dict[str, Any],
                      interval: str) -> tuple[dict[str, Any], list[str]]:
    """Prometheus' whole configuration: the MONITORS' jobs (service discovery SD), INTERVAL as the global scrape
    and evaluation interval, and what could not be translated."""
    jobs, warnings = scrape_configs(monitors, sd)
    config = {"global": {"scrape_interval": interval, "scrape_timeout": interval, "evaluation_interval": interval},
              "scrape_configs": jobs}
    return config, warnings
