"""A vLLM stand-in for CPUs: the same HTTP surface, metrics and KV events, with vLLM's continuous-batching scheduler
and a KV-cache model on a simulated clock. `profile` (capacity, step time), `calibrate` (a step time fitted to a
real engine), `engine` (scheduler, prefix cache, answers), `server` (the OpenAI API, /metrics), `validation` and
`params` (requests checked as vLLM checks them), `structured`, `tokenizer`, `cli`. Design: docs/simulator.md."""
