"""Everything tensorfleet says to the Kubernetes API, in one package.

What kopf does for the operator, and we do not redo:
  - the watch streams of InferenceServices, their children and engine pods
    (reconnects, 410 relists, backoff), filtered by label on the server;
  - the in-memory indexes built from those streams (`kopf.index`), which are
    the operator's informer cache: `cache.Children` reads from them, and kopf
    holds every handler back until every index has its initial listing.

What the `kubernetes` package does: loading the in-cluster or kubeconfig
configuration, exec credential plugins and token rotation (`connection`).

What we do ourselves, and why:
  - `client.Kube`: the requests a reconcile makes (GET, server-side apply,
    status patches, deletes with preconditions, events) on one aiohttp session.
    kopf has no public client for arbitrary kinds, and the `kubernetes`
    package is synchronous: its calls would block the event loop or need a
    thread per request.
  - `cache.Children`: a write-through overlay on kopf's indexes, so a
    reconcile sees its own writes before their watch events arrive.
  - `lease.LeaderElector`: client-go's Lease protocol. kopf's peering needs
    its own CRDs and pauses rather than fences; a Lease is what every
    Kubernetes controller uses.
  - `events.EventRecorder`: core/v1 Events with a repeat window (kopf posts
    events only from inside its handlers).
  - `client.Kube.watch`: the router's EndpointSlice discovery, the one watch
    outside the operator (the router does not run kopf).

`resources` lists every kind tensorfleet touches and the verbs it uses; the
chart's RBAC is generated from it. Only `cache` imports kopf, so the router
can use this package without the operator's dependencies.
"""
