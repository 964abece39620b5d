"""A vLLM stand-in for CPUs: the same HTTP surface and metrics, with a timing model.

`profile` takes the capacity it is handed (the operator's plan, as flags) and times steps from the catalog,
`engine` runs the continuous-batching scheduler and the prefix cache,
`server` speaks vLLM's OpenAI API and /metrics, `params` checks a request's
sampling parameters (n, stop, logprobs, echo, response_format: honoured or
refused with 400, never ignored), `structured` writes the JSON that
response_format asks for, `cli` is `tensorfleet sim`.
"""
