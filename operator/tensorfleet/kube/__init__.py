"""Everything tensorfleet says to the Kubernetes API, in one package: kopf's watches and indexes for the operator,
the `kubernetes` package's loaders for the connection, and our own async client, cache overlay, Lease election,
Events and table of kinds and verbs. Only `cache` imports kopf, so the router uses the rest without the operator's
dependencies. Design: docs/architecture.md#the-kubernetes-layer.
"""
