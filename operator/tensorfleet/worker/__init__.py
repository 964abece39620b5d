"""The launcher that runs inside every engine pod (`tensorfleet-worker`).

It reads its role from the env the renderer writes (`tensorfleet.contract`),
then, per role:

- pipeline 1: runs `vllm serve` (or `tensorfleet sim`) with flags from the env;
- pipeline > 1, stage 0: starts the Ray head, waits for the whole group to join,
  then runs `vllm serve ... --distributed-executor-backend ray`;
- pipeline > 1, stage k > 0: waits for the leader, joins its Ray cluster with
  `ray start --block`, and exits non-zero when the leader goes away.

It stays PID 1 of the container: it forwards SIGTERM to the engine after the
in-flight requests drain, reaps orphans, keeps a state file for
`tensorfleet-worker health`, and on GPU pods serves, on the GPU metrics port,
health gauges read with pynvml and the pod's `/health` (GPUs, its own phase,
and on stage 0 the engine's `/health`), which is their readiness probe. On a
pod planned for vLLM's CPU backend (TF_ACCELERATOR=CPU: CPU mode) it serves
that `/health` alone, without NVML: its own phase and the engine's `/health`.

Modules: `role` (env -> Role), `command` (Role -> argv), `raywait` (cluster
and leader waits), `supervise` (child process, signals, drain), `gpu` (NVML
sampling and health rules), `health` (the pod's verdict), `metrics`
(Prometheus exporter and `/health`), `state` (the state file), `launcher`
(the flows), `cli` (the command line).
"""
