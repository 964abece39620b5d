"""The test harness of tensorfleet, shared by tests/ and benchmarks/: the Kubernetes API emulator, stand-ins for the
workload controllers and the kubelet, the operator run against them, loopback servers and the real engine. Nothing
imports it at run time; it needs the `dev` extra, though importing the package itself imports none of that.
Design: docs/architecture.md#how-it-is-tested.
"""
