"""A vLLM stand-in for CPUs: the same HTTP surface and metrics, with a timing model.

`profile` derives capacity and timing from the planner and catalog,
`engine` runs the continuous-batching scheduler and the prefix cache,
`server` speaks vLLM's OpenAI API and /metrics, `cli` is `tensorfleet sim`.
"""
