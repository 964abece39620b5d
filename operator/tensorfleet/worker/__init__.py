"""The launcher that runs inside every engine pod (`tensorfleet-worker`): it reads its role from the env the renderer
writes, runs `vllm serve`, Ray or the simulator for that role, stays PID 1 to drain, reap and watch, and serves
the pod's `/health` (its readiness probe) and, on GPU pods, the GPU gauges. Design: docs/architecture.md#the-engine-pod.
"""
