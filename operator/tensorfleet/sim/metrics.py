"""vLLM's /metrics, with its names, labels and bucket edges, from the engine: gauges computed when scraped, one
registry per server. Design: docs/simulator.md#metrics."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tensorfleet import contract
from tensorfleet.sim.engine import Engine, SimRequest

# vLLM's bucket edges (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
ENGINE_INDEX = "0"  # vLLM labels each data-parallel engine; one engine here


def cache_config(block_size: int, num_blocks: int) -> dict[str, str]:
    """vLLM's `vllm:cache_config_info` labels (every field of its CacheConfig, as vLLM 0.19.1 writes them, with
    `engine` and without `model_name`), valued as a GPU engine with the defaults and this cache would value them."""
    return {
        "_block_size_resolved": "True", "block_size": str(block_size), "cache_dtype": "auto",
        "calculate_kv_scales": "False", "cpu_kvcache_space_bytes": "None", "enable_prefix_caching": "True",
        "gpu_memory_utilization": "0.9", "is_attention_free": "False", "kv_cache_dtype_skip_layers": "[]",
        "kv_cache_memory_bytes": "None", "kv_offloading_backend": "native", "kv_offloading_size": "None",
        "kv_sharing_fast_prefill": "False", "mamba_block_size": "None", "mamba_cache_dtype": "auto",
        "mamba_cache_mode": "none", "mamba_page_size_padded": "None", "mamba_ssm_cache_dtype": "auto",
        "num_cpu_blocks": "None", "num_gpu_blocks": str(num_blocks), "num_gpu_blocks_override": "None",
        "prefix_caching_hash_algo": "sha256", "sliding_window": "None", "user_specified_block_size": "False",
    }


def token_buckets(limit: int) -> tuple[int, ...]:
    """vLLM's buckets for per-request token counts: 1, 2, 5, 10, 20, 50, ... up to LIMIT."""
    edges: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            edge = mantissa * scale
            if edge > limit:
                return tuple(edges)
            edges.append(edge)
        scale *= 10


class _EngineCollector(Collector):
    """Gauges and counters read from the engine at scrape time: exact values
    with no bookkeeping on the request path."""

    def __init__(self, engine: Engine, names: Sequence[str], values: Sequence[str]) -> None:
        self.engine, self.names, self.values = engine, list(names), list(values)

    def collect(self) -> Iterator[Metric]:
        engine, names, values = self.engine, self.names, self.values
        stats = engine.stats
        for name, doc, value in (
            (contract.VLLM_METRIC_RUNNING, "Number of requests in model execution batches.", engine.num_running),
            (contract.VLLM_METRIC_WAITING, "Number of requests waiting to be processed.", engine.num_waiting),
            (contract.VLLM_METRIC_KV_CACHE_USAGE, "KV-cache usage. 1 means 100 percent usage.", engine.kv_usage),
        ):
            gauge = GaugeMetricFamily(name, doc, labels=names)
            gauge.add_metric(values, value)
            yield gauge
        config = cache_config(engine.profile.block_size, engine.profile.num_blocks)
        info = GaugeMetricFamily(contract.VLLM_METRIC_CACHE_CONFIG, "Information of the LLMEngine CacheConfig",
                                 labels=[contract.VLLM_LABEL_ENGINE, *config])
        info.add_metric([ENGINE_INDEX, *config.values()], 1.0)
        yield info
        for name, doc, total in (
            (contract.VLLM_METRIC_PROMPT_TOKENS, "Number of prefill tokens processed.", stats.prompt_tokens),
            (contract.VLLM_METRIC_GENERATION_TOKENS, "Number of generation tokens processed.", stats.generation_tokens),
            (contract.VLLM_METRIC_PREFIX_CACHE_QUERIES, "Prefix cache queries, in terms of number of queried tokens.",
             stats.prefix_queries),
            (contract.VLLM_METRIC_PREFIX_CACHE_HITS, "Prefix cache hits, in terms of number of cached tokens.",
             stats.prefix_hits),
            (contract.VLLM_METRIC_EXTERNAL_PREFIX_CACHE_QUERIES,
             ("External prefix cache queries from KV connector cross-instance cache sharing, in terms of number of "
              "queried tokens."), stats.external_queries),
            (contract.VLLM_METRIC_EXTERNAL_PREFIX_CACHE_HITS,
             ("External prefix cache hits from KV connector cross-instance cache sharing, in terms of number of "
              "cached tokens."), stats.external_hits),
            (contract.VLLM_METRIC_PREEMPTIONS, "Cumulative number of preemption from the engine.", stats.preemptions),
        ):
            counter = CounterMetricFamily(name, doc, labels=names)
            counter.add_metric(values, total)
            yield counter
        lora = engine.lora
        if lora is not None:
            running = ",".join(sorted({r.lora for r in engine.running if r.lora}))
            waiting = ",".join(sorted({r.lora for r in engine.waiting if r.lora}))
            info = GaugeMetricFamily(contract.VLLM_METRIC_LORA_INFO, "Running stats on lora requests.",
                                     labels=[contract.VLLM_LABEL_MAX_LORA, contract.VLLM_LABEL_LORA_WAITING,
                                             contract.VLLM_LABEL_LORA_RUNNING])
            info.add_metric([str(lora.config.max_loras), waiting, running], time.time())
            yield info
            loads = CounterMetricFamily(contract.SIM_METRIC_LORA_LOADS,
                                        "LoRA adapters brought into a GPU slot, by the tier it came from (the simulator's own).",
                                        labels=["tier"])
            loads.add_metric(["disk"], lora.loads)
            loads.add_metric(["cpu"], lora.swaps)
            yield loads


class EngineMetrics:
    def __init__(self, engine: Engine, served_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        names = [contract.VLLM_LABEL_MODEL_NAME, contract.VLLM_LABEL_ENGINE]
        values = (served_name, ENGINE_INDEX)
        reg = self.registry
        reg.register(_EngineCollector(engine, names, values))
        success = Counter(contract.VLLM_METRIC_REQUEST_SUCCESS, "Count of successfully processed requests.",
                          [*names, contract.VLLM_LABEL_FINISHED_REASON], registry=reg)
        # Every reason vLLM 0.19.1 exports a series for; the simulator's requests end in the first three.
        self._success = {reason: success.labels(*values, reason)
                         for reason in ("stop", "length", "abort", "error", "repetition")}
        self._ttft = Histogram(contract.VLLM_METRIC_TTFT, "Histogram of time to first token in seconds.", names,
                               buckets=TTFT_BUCKETS, registry=reg).labels(*values)
        self._e2e = Histogram(contract.VLLM_METRIC_E2E_LATENCY, "Histogram of e2e request latency in seconds.", names,
                              buckets=LATENCY_BUCKETS, registry=reg).labels(*values)
        self._queue = Histogram(contract.VLLM_METRIC_QUEUE_TIME, "Histogram of time spent in WAITING phase for request.",
                                names, buckets=LATENCY_BUCKETS, registry=reg).labels(*values)
        self._itl = Histogram(contract.VLLM_METRIC_ITL, "Histogram of inter-token latency in seconds.", names,
                              buckets=ITL_BUCKETS, registry=reg).labels(*values)
        self._computed = Histogram(contract.VLLM_METRIC_PREFILL_KV_COMPUTED,
                                   "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
                                   names, buckets=token_buckets(engine.profile.max_model_len),
                                   registry=reg).labels(*values)
        engine.on_first_token = self._first_token
        engine.on_finish = self._finished
        engine.on_abort = self._success["abort"].inc

    def _first_token(self, request: SimRequest, now: float) -> None:
        self._ttft.observe(now - request.arrival)
        if request.scheduled_at is not None:
            self._queue.observe(request.scheduled_at - request.arrival)

    def _finished(self, request: SimRequest, now: float) -> None:
        self._e2e.observe(now - request.arrival)
        if request.scheduled_at is not None:
            self._computed.observe(request.computed_prompt)
        if request.generated > 1 and request.first_token_at is not None:
            self._itl.observe((now - request.first_token_at) / (request.generated - 1))
        child = self._success.get(request.finish_reason or "")
        if child is not None:
            child.inc()
