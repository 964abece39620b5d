"""The OpenAI-compatible, load-aware router in front of an InferenceService's engines.

`backends` (pool, circuit breakers, scraped load), `strategies` (which engine),
`dispatch` (concurrency ceilings, the bounded queue, the request-body budget), `discovery`
(EndpointSlices), `app` (the HTTP server), `metrics`, `cli`.
"""
