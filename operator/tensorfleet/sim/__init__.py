"""A vLLM stand-in for CPUs: the same HTTP surface and metrics, with a timing model.

`profile` takes the capacity it is handed (the operator's plan, as flags) and times steps from the catalog,
or from a step time fitted to a real engine: `calibrate` is `tensorfleet sim calibrate`, which measures a
running vLLM and writes the profile `tensorfleet sim --profile` loads,
`engine` runs the continuous-batching scheduler and the prefix cache,
`server` speaks vLLM's OpenAI API and /metrics, `validation` validates request
bodies as vLLM does (its pydantic models and validators, its errors), `params`
checks a request's sampling parameters (n, stop, logprobs, echo,
response_format: honoured or refused with 400, never ignored), `structured`
writes the JSON that response_format asks for, `cli` is `tensorfleet sim`.

tests/test_sim_vs_vllm.py holds the simulator to a real vLLM (the release the
default engine image pins): the same requests to both, the answers compared
(status codes, fields, errors, streams, LoRA endpoints, /metrics families), and
every difference left listed with its reason (docs/real-engine.md).
"""
