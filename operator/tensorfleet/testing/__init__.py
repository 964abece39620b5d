"""The test harness of tensorfleet, shared by tests/ and benchmarks/.

- `kube_emulator`: kmock's Kubernetes API emulator, extended with the API-server
  behaviour the operator relies on, and fault injection;
- `fake_workloads`: stand-ins for the StatefulSet/Deployment controllers and the kubelet;
- `operator_harness`: the emulator on its own thread, the operator run against it,
  and `eventually`;
- `loopback`: real simulator and router servers on 127.0.0.1, and helpers to talk to them.

Nothing in the operator, router, simulator or worker imports this package at run
time. It needs the `dev` extra (`pip install -e '.[dev]'`): kmock for the
emulator, and the operator, router and simulator extras for what it runs.
Importing the package itself imports none of that; each module imports what it uses.
"""
