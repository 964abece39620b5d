"""tensorfleet.promtext, the one reader of Prometheus text, and the callers that scrape engines with it."""

from __future__ import annotations

import math
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from tensorfleet import contract, promtext
from tensorfleet.promtext import Sample
from tensorfleet.router.backends import parse_engine_metrics
from tensorfleet.worker.supervise import in_flight

MODEL = "meta-llama/Llama-3.1-8B-Instruct"

# What vLLM v1 serves on /metrics (abridged), as prometheus_client writes it.
VLLM = f"""# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{{generation="0"}} 12731.0
python_gc_objects_collected_total{{generation="1"}} 3351.0
# HELP process_virtual_memory_bytes Virtual memory size in bytes.
# TYPE process_virtual_memory_bytes gauge
process_virtual_memory_bytes 1.2716056576e+011
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",model_name="{MODEL}"}} 5.0
vllm:num_requests_running{{engine="1",model_name="{MODEL}"}} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{engine="0",model_name="{MODEL}"}} 3.0
vllm:num_requests_waiting{{engine="1",model_name="{MODEL}"}} 0.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{engine="0",model_name="{MODEL}"}} 0.25
vllm:kv_cache_usage_perc{{engine="1",model_name="{MODEL}"}} 0.75
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{{engine="0",model_name="{MODEL}"}} 48213.0
vllm:prompt_tokens_total{{engine="1",model_name="{MODEL}"}} 1787.0
# HELP vllm:request_success_total Count of successfully processed requests.
# TYPE vllm:request_success_total counter
vllm:request_success_total{{engine="0",finished_reason="stop",model_name="{MODEL}"}} 91.0
vllm:request_success_total{{engine="0",finished_reason="length",model_name="{MODEL}"}} 9.0
vllm:request_success_total{{engine="0",finished_reason="abort",model_name="{MODEL}"}} 0.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_sum{{engine="0",model_name="{MODEL}"}} 4.5
vllm:time_to_first_token_seconds_bucket{{engine="0",le="0.001",model_name="{MODEL}"}} 0.0
vllm:time_to_first_token_seconds_bucket{{engine="0",le="0.04",model_name="{MODEL}"}} 60.0
vllm:time_to_first_token_seconds_bucket{{engine="0",le="+Inf",model_name="{MODEL}"}} 100.0
vllm:time_to_first_token_seconds_count{{engine="0",model_name="{MODEL}"}} 100.0
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{{block_size="16",cache_dtype="auto",engine="0",num_gpu_blocks="27000",prefix_caching="True"}} 1.0
vllm:cache_config_info{{block_size="16",cache_dtype="auto",engine="1",num_gpu_blocks="27000",prefix_caching="True"}} 1.0
"""


# --- the reader ----------------------------------------------------------------------


def test_vllm_names_keep_their_colons_and_counters_their_total() -> None:
    parsed = promtext.samples(VLLM)
    assert parsed[0] == Sample("python_gc_objects_collected_total", {"generation": "0"}, 12731.0)
    assert promtext.value(parsed, contract.VLLM_METRIC_WAITING, engine="0") == 3.0
    assert promtext.total(parsed, contract.VLLM_METRIC_RUNNING) == 7.0
    assert promtext.total(parsed, contract.VLLM_METRIC_PROMPT_TOKENS + "_total", model_name=MODEL) == 50000.0
    # The family name (without `_total`) is not a sample name.
    assert promtext.select(parsed, contract.VLLM_METRIC_PROMPT_TOKENS) == []
    assert promtext.value(parsed, contract.VLLM_METRIC_REQUEST_SUCCESS + "_total", finished_reason="length") == 9.0
    assert promtext.value(parsed, "process_virtual_memory_bytes") == 1.2716056576e11
    info = promtext.select(parsed, contract.VLLM_METRIC_CACHE_CONFIG, engine="1")
    assert [s.labels["num_gpu_blocks"] for s in info] == ["27000"]


def test_histograms_read_as_bucket_sum_and_count() -> None:
    ttft = contract.VLLM_METRIC_TTFT
    assert [(s.labels["le"], s.value) for s in promtext.select(VLLM, ttft + "_bucket")] == [
        ("0.001", 0.0), ("0.04", 60.0), ("+Inf", 100.0)]
    assert promtext.value(VLLM, ttft + "_bucket", le="+Inf") == 100.0
    assert promtext.value(VLLM, ttft + "_sum") == 4.5
    assert promtext.value(VLLM, ttft + "_count") == 100.0
    assert promtext.select(VLLM, ttft) == []


def test_our_own_metrics_round_trip() -> None:
    # What the router, the operator and the worker serve: prometheus_client's output.
    registry = CollectorRegistry()
    requests = Counter(contract.ROUTER_METRIC_REQUESTS, "requests", ["backend", "code"], registry=registry)
    duration = Histogram(contract.ROUTER_METRIC_DURATION, "duration", ["code"], buckets=(0.01, 1.0), registry=registry)
    pending = Gauge(contract.ROUTER_METRIC_PENDING, "pending", registry=registry)
    usage = Gauge("vllm:kv_cache_usage_perc", "usage", ["model_name"], registry=registry)
    url = "http://10.0.0.7:8000"
    requests.labels(backend=url, code="200").inc(3)
    requests.labels(backend="none", code="429").inc()
    duration.labels(code="429").observe(0.005)
    duration.labels(code="429").observe(0.5)
    pending.set(2)
    usage.labels(model_name='say "hi" \\ there\nnow').set(float("nan"))
    text = generate_latest(registry).decode()

    assert promtext.value(text, contract.ROUTER_METRIC_REQUESTS + "_total", backend=url, code="200") == 3
    assert promtext.total(text, contract.ROUTER_METRIC_REQUESTS + "_total") == 4
    assert promtext.value(text, contract.ROUTER_METRIC_REQUESTS + "_total", backend=url, code="500") is None
    assert promtext.value(text, contract.ROUTER_METRIC_DURATION + "_bucket", code="429", le="0.01") == 1
    assert promtext.value(text, contract.ROUTER_METRIC_DURATION + "_bucket", code="429", le="+Inf") == 2
    assert promtext.value(text, contract.ROUTER_METRIC_DURATION + "_count", code="429") == 2
    assert promtext.value(text, contract.ROUTER_METRIC_DURATION + "_sum", code="429") == pytest.approx(0.505)
    assert promtext.value(text, contract.ROUTER_METRIC_PENDING) == 2
    # Escaped label values come back unescaped, and match as written.
    (sample,) = promtext.select(text, "vllm:kv_cache_usage_perc")
    assert sample.labels == {"model_name": 'say "hi" \\ there\nnow'}
    assert math.isnan(sample.value)
    (again,) = promtext.select(text, "vllm:kv_cache_usage_perc", model_name='say "hi" \\ there\nnow')
    assert again.labels == sample.labels


def test_labels_with_quotes_braces_and_spaces() -> None:
    text = 'm{path="/a b}",q="x \\"y\\" z"} 1.5 1700000000000\nm{path="c"} 2\n'
    assert promtext.samples(text) == [Sample("m", {"path": "/a b}", "q": 'x "y" z'}, 1.5),
                                      Sample("m", {"path": "c"}, 2.0)]
    assert promtext.value(text, "m", q='x "y" z') == 1.5      # the timestamp is not the value
    assert promtext.value(text, "m") == 1.5                   # the first that matches
    assert promtext.total(text, "m") == 3.5


def test_special_values() -> None:
    parsed = promtext.samples("a NaN\nb +Inf\nc -Inf\nd 1e3\ne 7\n")
    assert math.isnan(parsed[0].value)
    assert [s.value for s in parsed[1:]] == [math.inf, -math.inf, 1000.0, 7.0]
    assert all(type(s.value) is float for s in parsed)
    assert math.isnan(promtext.total(parsed, "a"))


def test_nothing_to_read() -> None:
    assert promtext.samples("") == []
    assert promtext.samples("\n# just a comment\n\n") == []
    assert promtext.value("", "x") is None
    assert promtext.total("", "x") == 0.0


def test_a_counter_declared_without_total_reads_with_it() -> None:
    # prometheus_client's convention (promtext.samples says so).
    assert promtext.samples("# TYPE legacy counter\nlegacy 4\n") == [Sample("legacy_total", {}, 4.0)]


@pytest.mark.parametrize("text", [
    "<html><body>502 Bad Gateway</body></html>\n",
    "Not Found",
    '{"error": "nope"}',
    "vllm:num_requests_waiting{engine=\"0\"} three\n",
    "vllm:num_requests_waiting{engine=\"0\" 3\n",
    "vllm:num_requests_waiting{engine=0} 3\n",
    "ok 1\nbroken line here\n",
    "# TYPE x\nx 1\n",
])
def test_malformed_text_raises_value_error(text: str) -> None:
    with pytest.raises(ValueError, match="malformed Prometheus text"):
        promtext.samples(text)
    # Naming metrics does not change that: the named lines are parsed, or the whole text when none is there.
    with pytest.raises(ValueError, match="malformed Prometheus text"):
        promtext.samples(text, names={"vllm:num_requests_waiting"})
    with pytest.raises(ValueError, match="malformed Prometheus text"):
        promtext.value(text, "x")


@pytest.mark.parametrize("names", [
    {"vllm:num_requests_running"},
    {"vllm:prompt_tokens_total", "vllm:kv_cache_usage_perc"},
    {"vllm:time_to_first_token_seconds_bucket", "vllm:time_to_first_token_seconds_count"},
    {"vllm:cache_config_info", "process_virtual_memory_bytes", "python_gc_objects_collected_total"},
])
def test_named_samples_are_those_of_the_whole_page(names: set[str]) -> None:
    whole = [s for s in promtext.samples(VLLM) if s.name in names]
    assert whole and {s.name for s in whole} == names
    assert promtext.samples(VLLM, names=names) == whole


def test_named_samples_read_indented_lines_as_the_parser_does() -> None:
    text = "up 1\n  want 2\n\twant{a=\"b\"} 3\nwant 4\n"
    assert promtext.samples(text, names={"want"}) == [s for s in promtext.samples(text) if s.name == "want"]
    assert len(promtext.samples(text, names={"want"})) == 3


def test_named_samples_read_a_counter_declared_without_total() -> None:
    text = "# HELP legacy Old style.\n# TYPE legacy counter\nlegacy 4\nother 1\n"
    assert promtext.samples(text, names={"legacy_total"}) == [Sample("legacy_total", {}, 4.0)]


def test_named_samples_skip_the_rest_of_the_page() -> None:
    # Lines of other families are not parsed at all: a line the parser would refuse does not matter.
    text = VLLM + "some_exporter_extension{a=\"b\"} not-a-number\n"
    with pytest.raises(ValueError):
        promtext.samples(text)
    assert promtext.value(promtext.samples(text, names={"vllm:num_requests_waiting"}),
                          "vllm:num_requests_waiting") == 3.0
    # A name that is a prefix of another family's does not pick that family.
    assert promtext.samples(VLLM, names={"vllm:num_requests"}) == []


# --- callers that scrape engines -------------------------------------------------------


def test_router_reads_vllm_load() -> None:
    load = parse_engine_metrics(VLLM)
    assert (load.waiting, load.running, load.kv_cache_tokens) == (3.0, 7.0, 2 * 16 * 27000)
    assert load.kv_usage == pytest.approx(0.5)


def test_router_reads_nan_as_zero_and_fails_on_bad_text() -> None:
    load = parse_engine_metrics("vllm:num_requests_waiting NaN\nvllm:kv_cache_usage_perc NaN\n")
    assert (load.waiting, load.kv_usage, load.kv_cache_tokens) == (0.0, 0.0, None)
    # Fleet._check (router/fleet.py) counts an exception here as a failed health check.
    with pytest.raises(ValueError):
        parse_engine_metrics("<html>upstream connect error</html>")


def _serve(body: str) -> tuple[ThreadingHTTPServer, int]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            data = body.encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *_: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, server.server_address[1]


@pytest.mark.parametrize(("body", "expected"), [
    (VLLM, 10),                                                                   # 7 running + 3 waiting
    ("vllm:num_requests_running 2.0\nvllm:num_requests_waiting NaN\n", 2),
    ("process_open_fds 12\n", 0),
    ("<html>not metrics</html>", None),                                          # a failed scrape
])
def test_drain_counts_requests_in_flight(body: str, expected: int | None) -> None:
    server, port = _serve(body)
    try:
        assert in_flight(port) == expected
    finally:
        server.shutdown()
        server.server_close()
