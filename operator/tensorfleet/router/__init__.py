"""The OpenAI-compatible, load-aware router in front of an InferenceService's engines.

`backends` (pool, circuit breakers, scraped load), `scheduling` (which engine: filters, scorers, profiles),
`dispatch` (concurrency ceilings, the bounded queue shared fairly among tenants, the request-body
budget), `tenants` (API keys, per-key rate limits), `discovery` (EndpointSlices), `app` (the HTTP
server), `admission` (what it refuses itself), `fleet` (the engines' health and discovery), `adapters`
(their models and LoRA adapters), `forward` (retries, resumption), `proxy` (one attempt on one engine),
`inflight` (the watchdog, the shutdown), `config`, `metrics`, `cli`.
"""

# Retry-After (seconds) of the router's 503 when it knows no engine at all (none ready or starting, or discovery
# failing): nothing to derive a time from. Here, not in fleet.py, so the CLI's help can say it without aiohttp.
NO_ENGINE_RETRY_SECONDS = 10
