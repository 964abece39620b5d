"""The OpenAI-compatible, load-aware router in front of an InferenceService's engines, one module per job (each named,
with what it does, in the layers' table). Design: docs/architecture.md#layers-one-way-only.
"""

# Retry-After (seconds) of the router's 503 when it knows no engine at all (none ready or starting, or discovery
# failing): nothing to derive a time from. Here, not in fleet.py, so the CLI's help can say it without aiohttp.
NO_ENGINE_RETRY_SECONDS = 10
