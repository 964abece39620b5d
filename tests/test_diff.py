"""controller.diff.contains: when is a live object already what we would apply?"""

from __future__ import annotations

import pytest

from tensorfleet.controller.diff import contains

# What the real API server returned for the headless engine Service the operator
# applies (kube-apiserver 1.36): defaults added, `publishNotReadyAddresses: false` omitted.
LIVE_SERVICE = {
    "metadata": {"name": "x-engine", "labels": {"a": "b"}},
    "spec": {"clusterIP": "None", "clusterIPs": ["None"], "internalTrafficPolicy": "Cluster",
             "ipFamilies": ["IPv4"], "ipFamilyPolicy": "SingleStack",
             "ports": [{"name": "http", "port": 8000, "protocol": "TCP", "targetPort": "http"}],
             "selector": {"s": "0"}, "sessionAffinity": "None", "type": "ClusterIP"},
}


def test_defaults_added_by_the_server_do_not_count_as_a_difference() -> None:
    desired = {"metadata": {"name": "x-engine", "labels": {"a": "b"}},
               "spec": {"clusterIP": "None", "ports": [{"name": "http", "port": 8000, "targetPort": "http"}],
                        "selector": {"s": "0"}}}
    assert contains(LIVE_SERVICE, desired)


@pytest.mark.parametrize("zero", [False, 0, 0.0, "", [], {}, None])
def test_a_zero_value_the_server_omits_is_held_by_its_absence(zero: object) -> None:
    desired = {"spec": {"clusterIP": "None", "publishNotReadyAddresses": zero}}
    assert contains(LIVE_SERVICE, desired)


@pytest.mark.parametrize("value", [True, 1, "x", ["a"], {"k": "v"}])
def test_a_non_zero_value_must_be_present(value: object) -> None:
    desired = {"spec": {"clusterIP": "None", "publishNotReadyAddresses": value}}
    assert not contains(LIVE_SERVICE, desired)


def test_changed_values_and_list_lengths_differ() -> None:
    assert not contains(LIVE_SERVICE, {"spec": {"selector": {"s": "1"}}})
    assert not contains(LIVE_SERVICE, {"spec": {"ports": []}}), "an empty list is not the one-port list"
    assert not contains(LIVE_SERVICE, {"spec": {"ports": [{"port": 8000}, {"port": 9000}]}})


def test_quantities_compare_by_value() -> None:
    assert contains({"cpu": "500m"}, {"cpu": "0.5"})
    assert contains({"memory": "1Gi"}, {"memory": "1073741824"})
    assert not contains({"cpu": "500m"}, {"cpu": "1"})
