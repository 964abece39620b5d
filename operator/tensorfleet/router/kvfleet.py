"""The router's KV-event subscriptions, one per engine in its pool, feeding one KV-cache index
(router/kvindex.py), and their metrics. An engine that leaves the pool leaves the index. Design:
docs/routing.md#the-kv-cache-index.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Iterator
from urllib.parse import urlsplit

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tensorfleet import contract
from tensorfleet.router.kvevents import Subscriber, endpoints
from tensorfleet.router.kvindex import KVIndex


def engine_endpoints(url: str) -> tuple[str, str] | None:
    host = urlsplit(url).hostname
    return endpoints(host) if host else None


class KVEventFleet(Collector):
    """Subscriptions by engine URL (the pool's names for engines, and the index's)."""

    def __init__(self, given: Iterable[tuple[str, str, str]] = ()) -> None:
        """GIVEN: (engine URL, publisher, replay) for engines not on their address's contract ports."""
        self.index = KVIndex()
        self._subscribers: dict[str, tuple[Subscriber, asyncio.Task[None]]] = {}
        self._given = {url: (publisher, replay) for url, publisher, replay in given}

    def endpoints(self, url: str) -> tuple[str, str] | None:
        """An engine URL's publisher and replay endpoints: as given, else its address on the contract's ports."""
        return self._given.get(url.rstrip("/")) or engine_endpoints(url)

    def sync(self, urls: Iterable[str]) -> None:
        """Subscribe to every engine of `urls` not yet subscribed; drop the others. Needs a running loop."""
        wanted = set(urls)
        for url in [url for url in self._subscribers if url not in wanted]:
            _, task = self._subscribers.pop(url)
            task.cancel()
            self.index.forget(url)
        for url in wanted - self._subscribers.keys():
            found = self.endpoints(url)
            if found is None:
                continue
            endpoint, replay = found
            subscriber = Subscriber(self.index, url, endpoint, replay)
            task = asyncio.get_running_loop().create_task(subscriber.run(), name=f"router-kv-events {url}")
            self._subscribers[url] = subscriber, task

    def subscriber(self, url: str) -> Subscriber | None:
        entry = self._subscribers.get(url)
        return entry[0] if entry else None

    async def close(self) -> None:
        tasks = [task for _, task in self._subscribers.values()]
        self._subscribers.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def collect(self) -> Iterator[Metric]:
        label = [contract.ROUTER_LABEL_BACKEND]
        blocks = GaugeMetricFamily(contract.ROUTER_METRIC_KV_BLOCKS,
                                   "KV-cache blocks the engine holds, by its own KV events.", labels=label)
        events = CounterMetricFamily(contract.ROUTER_METRIC_KV_EVENTS,
                                     "KV events read from the engine (stored, removed, cleared).", labels=label)
        resyncs = CounterMetricFamily(contract.ROUTER_METRIC_KV_RESYNCS,
                                      "Times the engine's part of the index was dropped: the engine restarted, or "
                                      "events were lost beyond its replay buffer.", labels=label)
        for url, (subscriber, _) in sorted(self._subscribers.items()):
            blocks.add_metric([url], self.index.blocks(url))
            events.add_metric([url], subscriber.stats.events)
            resyncs.add_metric([url], subscriber.stats.resyncs)
        yield from (blocks, events, resyncs)
