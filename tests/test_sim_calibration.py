"""The calibrated simulator (sim/calibrate.py): the fit, the profile file, `tensorfleet sim --profile`, and
`tensorfleet sim calibrate` against a real vLLM."""

from __future__ import annotations

import asyncio
import json
import math
import random
import urllib.request
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tensorfleet import contract, promtext
from tensorfleet.cli import build_parser
from tensorfleet.cli import main as tensorfleet_main
from tensorfleet.sim import calibrate, probe
from tensorfleet.sim.calibrate import (
    CalibrationError,
    Capacity,
    DecodePoint,
    PrefillPoint,
    SustainedPoint,
    Sweep,
    fit,
    load,
    parse,
)
from tensorfleet.sim.cli import build_profile
from tensorfleet.sim.engine import Engine
from tensorfleet.sim.probe import decode_window
from tensorfleet.sim.profile import StepModel, make_profile
from tensorfleet.testing.loopback import MODEL, free_port, metric_value, sim, spawn_sim, wait_healthy

# A GPU-like engine: 6 ms a step, 0.05 ms more per sequence, 0.2 ms per 1,000 prompt tokens, 4 ms per million
# tokens of context, 12 ms before a request's first step (20 ms while other requests run).
KNOWN = StepModel(overhead_s=0.006, per_decode_seq_s=0.00005, per_prefill_token_s=0.0000002,
                  per_context_token_s=0.000000004, first_token_s=0.012, first_token_busy_s=0.02)
BUDGET = 2048


def sweep_of(model: StepModel, noise: float = 0.0, seed: int = 0) -> tuple[list[DecodePoint], list[PrefillPoint]]:
    """What the calibration would measure on an engine timed by MODEL, each figure off by up to NOISE."""
    rng = random.Random(seed)

    def jitter(value: float) -> float:
        return value * (1 + rng.uniform(-noise, noise))

    decode = []
    for prompt in (64, 1024):
        for n in (1, 2, 4, 8, 16, 32):
            context = n * (prompt + 32)
            decode.append(DecodePoint(n, prompt, context, jitter(model.step_seconds(n, context, 0)), n, 1.0))
    prefill = []
    background, context = 2, 2 * 300
    for tokens in (16, 128, 512, 1024, 2048, 4096):
        chunks = math.ceil(tokens / BUDGET)
        # A prompt over the budget takes several steps; the first token waits first_token_s besides.
        seconds = model.first_token_s + sum(model.step_seconds(0, 0, min(BUDGET, tokens - k * BUDGET))
                                            for k in range(chunks))
        prefill.append(PrefillPoint(tokens, chunks, jitter(seconds)))
        # Behind two decoding requests: half the step in progress, then steps shared with them.
        room = BUDGET - background
        chunks = math.ceil(tokens / room)
        assert model.first_token_busy_s is not None
        seconds = (model.first_token_busy_s + 0.5 * model.step_seconds(background, context, 0)
                   + sum(model.step_seconds(background, context, min(room, tokens - k * room)) for k in range(chunks)))
        prefill.append(PrefillPoint(tokens, chunks, jitter(seconds), background=background, background_context=context))
    return decode, prefill


def sustained_of(model: StepModel) -> list[SustainedPoint]:
    """Closed loops at 4, 8 and 16: mean steps holding that many decoding sequences, some prefill and context."""
    out = []
    for n in (4, 8, 16):
        decoding, prefill, context = n - 0.2, 4.0 * n, n * 600.0
        step = (model.overhead_s + model.per_decode_seq_s * decoding + model.per_prefill_token_s * prefill
                + model.per_context_token_s * context)
        out.append(SustainedPoint(n, 5.0, round(5.0 / step), 0, 0, step, decoding, prefill, context))
    return out


def close(a: float, b: float, rel: float) -> bool:
    return abs(a - b) <= rel * abs(b)


# --- the fit ---------------------------------------------------------------------------------------------------


def test_the_fit_recovers_known_constants() -> None:
    result = fit(*sweep_of(KNOWN), sustained_of(KNOWN))
    for term in calibrate.TERMS:
        assert close(getattr(result.model, term), getattr(KNOWN, term), 1e-6), term
    assert result.dropped == ()
    assert result.max_relative_error < 1e-9
    assert len(result.rows) == 12 + 12 + 3
    assert [r["kind"] for r in result.rows].count("sustained") == 3


def test_sustained_steps_slower_than_clean_ones_pull_the_fit_toward_them() -> None:
    """An engine whose steps under a mixed load are 30% slower than its clean decode and prefill steps (a CPU
    engine sharing its cores with its HTTP side): with the sustained rows the fit predicts slower steps under load
    than without them, and misses them by less."""
    decode, prefill = sweep_of(KNOWN)
    slow = [replace(p, step_s=p.step_s * 1.3) for p in sustained_of(KNOWN)]
    clean, pulled = fit(decode, prefill).model, fit(decode, prefill, slow).model

    def predicted(model: StepModel, p: SustainedPoint) -> float:
        return (model.overhead_s + model.per_decode_seq_s * p.decode_seqs + model.per_prefill_token_s * p.prefill_tokens
                + model.per_context_token_s * p.context_tokens)

    for p in slow:
        assert predicted(clean, p) < predicted(pulled, p) < p.step_s
    assert max(abs(predicted(pulled, p) / p.step_s - 1) for p in slow) < \
        max(abs(predicted(clean, p) / p.step_s - 1) for p in slow)


def test_the_fit_holds_up_to_noise() -> None:
    """With every figure off by up to 3%, the step times it predicts are within a few percent of the truth over
    the range measured (single constants may move more: the terms trade off against each other)."""
    result = fit(*sweep_of(KNOWN, noise=0.03, seed=7))
    model = result.model
    for n in (1, 4, 16, 32):
        for context in (n * 100, n * 1000):
            assert close(model.step_seconds(n, context, 0), KNOWN.step_seconds(n, context, 0), 0.05), (n, context)
    for tokens in (100, 1000, 2000):
        assert close(model.step_seconds(0, 0, tokens), KNOWN.step_seconds(0, 0, tokens), 0.05), tokens
    assert close(model.first_token_s, KNOWN.first_token_s, 0.25)
    assert model.first_token_busy_s is not None and KNOWN.first_token_busy_s is not None
    assert close(model.first_token_busy_s, KNOWN.first_token_busy_s, 0.25)
    assert 0 < result.max_relative_error <= 0.06


def test_the_fit_drops_terms_the_sweep_cannot_tell_apart_or_that_come_out_negative() -> None:
    decode, prefill = sweep_of(KNOWN)
    # One context length only: context tokens move with the batch, so that term cannot be told from the
    # per-sequence one and is dropped, not guessed.
    one_context = [p for p in decode if p.prompt_tokens == 64]
    idle = [p for p in prefill if not p.background]
    result = fit(one_context, idle)
    assert [d.split(":")[0] for d in result.dropped] == ["first_token_busy_s", "per_context_token_s"]
    assert "no measurement" in result.dropped[0] and "cannot tell" in result.dropped[1]
    assert result.model.per_context_token_s == 0
    assert result.model.first_token_busy_s is None  # not measured: the simulator uses the idle figure
    assert result.model.first_token_delay(busy=True) == result.model.first_token_s
    # An engine whose steps get faster with context (noise, not physics) gets no negative coefficient.
    faster = [DecodePoint(p.concurrency, p.prompt_tokens, p.context_tokens,
                          p.itl_s * (0.8 if p.prompt_tokens == 1024 else 1.0), p.requests, p.window_s)
              for p in decode]
    result = fit(faster, prefill)
    assert result.model.per_context_token_s == 0
    assert any(d.startswith("per_context_token_s: fitted negative") for d in result.dropped)
    assert all(getattr(result.model, term) >= 0 for term in calibrate.TERMS)
    with pytest.raises(CalibrationError):
        fit([], [])


def test_the_decode_window_is_where_every_request_decodes() -> None:
    """Four requests started together, their first tokens at 0.1-0.4 s (prefill in turn), then one token every
    20 ms, sent in bursts of three: the window starts at the last first token and ends at the first last one, and
    the slope through each request's events is the step."""
    step, runs = 0.020, []
    for i in range(4):
        first = 0.1 * (i + 1)
        runs.append([(first + (k - 1) * step, k) for k in range(1, 60) if k == 1 or k % 3 == 0])
    itl, context, used, seconds = decode_window(runs, 100) or (0.0, 0, 0, 0.0)
    assert close(itl, step, 1e-9)
    assert used == 4
    assert close(seconds, runs[0][-1][0] - 0.4, 1e-9)
    assert 4 * 100 < context < 4 * (100 + 60)
    # Requests that never decode together: no window.
    assert decode_window([[(0.0, 1), (0.1, 5)], [(0.2, 1), (0.3, 5)]], 10) is None
    # A window that is one burst (the second request's first 30 tokens came at once, late): not a measurement.
    burst = [[(0.1 + k * step, k) for k in range(1, 41)], [(0.75, 30), *((0.75 + k * step, 30 + k) for k in range(1, 11))]]
    assert decode_window(burst, 10) is None


def test_the_fit_takes_the_median_of_a_points_repeats() -> None:
    decode, prefill = sweep_of(KNOWN)
    stalled = [replace(p, itl_s=p.itl_s * 3) for p in decode]  # one repeat of each point hit a stall
    result = fit([*decode, *stalled, *decode], prefill)
    assert len(result.rows) == len(decode) + len(prefill)
    for term in calibrate.TERMS:
        assert close(getattr(result.model, term), getattr(KNOWN, term), 1e-6), term


# --- the profile file ------------------------------------------------------------------------------------------


def profile_document(**capacity: Any) -> dict[str, Any]:
    decode, prefill = sweep_of(KNOWN)
    cap = Capacity(**{"max_model_len": 2048, "block_size": 128, "num_gpu_blocks": 64, **capacity})
    sustained = sustained_of(KNOWN)
    return calibrate.document({"url": "http://engine:8000", "version": "0.19.1", "model": "tiny", "root": "/m/tiny"},
                              cap, Sweep(), decode, prefill, fit(decode, prefill, sustained), sustained=sustained)


def test_a_profile_round_trips_through_the_file(tmp_path: Path) -> None:
    doc = profile_document(max_num_seqs=16, max_num_seqs_source="learned")
    path = tmp_path / "profile.json"
    calibrate.write(path, doc)
    back = load(path)
    assert back.step == fit(*sweep_of(KNOWN), sustained_of(KNOWN)).model
    assert back.capacity == Capacity(max_model_len=2048, block_size=128, num_gpu_blocks=64, max_num_seqs=16,
                                     max_num_seqs_source="learned")
    assert back.capacity.kv_cache_tokens == 128 * 64
    assert back.engine["version"] == "0.19.1"
    raw = json.loads(path.read_text())
    assert (raw["kind"], raw["version"]) == (calibrate.PROFILE_KIND, calibrate.PROFILE_VERSION)
    assert len(raw["measurements"]["decode"]) == 12 and len(raw["measurements"]["prefill"]) == 12
    assert len(raw["measurements"]["sustained"]) == 3
    assert len(raw["fit"]["rows"]) == 27


@pytest.mark.parametrize(("change", "message"), [
    ({"kind": "something else"}, "not a simulator profile"),
    ({"version": 99}, "profile version 99"),
    ({"fit": None}, "no \"fit\" object"),
    ({"fit": {"overhead_s": -1.0}}, "fit.overhead_s must be a non-negative number"),
    ({"fit": {"per_decode_seq_s": "fast"}}, "fit.per_decode_seq_s must be a non-negative number"),
    ({"capacity": {"num_gpu_blocks": 0}}, "capacity.num_gpu_blocks must be a positive integer"),
])
def test_a_file_that_is_not_a_valid_profile_is_refused_saying_why(change: dict[str, Any], message: str) -> None:
    doc = profile_document()
    for key, value in change.items():
        doc[key] = {**doc[key], **value} if isinstance(value, dict) and isinstance(doc.get(key), dict) else value
    with pytest.raises(CalibrationError, match=message):
        parse(doc)


def test_the_profile_gives_the_capacity_unless_flags_do_and_the_roofline_stays_without_one(tmp_path: Path) -> None:
    path = tmp_path / "profile.json"
    calibrate.write(path, profile_document(max_num_seqs=16, max_num_batched_tokens=1024))

    def profile_for(*flags: str) -> Any:
        return build_profile(build_parser().parse_args(["sim", "--served-model-name", "m", *flags]))

    calibrated = profile_for("--profile", str(path))
    assert calibrated.fitted == load(path).step
    assert (calibrated.kv_cache_tokens, calibrated.block_size, calibrated.num_blocks) == (128 * 64, 128, 64)
    assert (calibrated.max_model_len, calibrated.max_num_seqs, calibrated.max_num_batched_tokens) == (2048, 16, 1024)
    assert calibrated.model == "/m/tiny"
    assert close(calibrated.step_seconds(3, 500, 100), KNOWN.step_seconds(3, 500, 100), 1e-6)
    flagged = profile_for("--profile", str(path), "--max-num-seqs", "4", "--kv-cache-tokens", "4096",
                          "--block-size", "16", "--max-model-len", "1024")
    assert (flagged.max_num_seqs, flagged.kv_cache_tokens, flagged.block_size, flagged.max_model_len) == (4, 4096, 16, 1024)
    assert flagged.fitted == calibrated.fitted
    # Without --profile: the catalog's roofline, as before.
    plain = profile_for()
    assert plain.fitted is None
    assert plain == make_profile()
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(SystemExit, match="--profile .*broken.json: not JSON"):
        profile_for("--profile", str(tmp_path / "broken.json"))
    with pytest.raises(SystemExit, match="--profile .*missing.json: cannot read"):
        profile_for("--profile", str(tmp_path / "missing.json"))


# --- the simulator timed by a profile -------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_the_engine_times_its_steps_by_the_fitted_model() -> None:
    """One request of P prompt tokens and M answer tokens is a prefill step and M - 1 decode steps, each at its
    context: the engine's simulated seconds are exactly what the fitted model says."""
    profile = replace(make_profile(kv_cache_tokens=8192, block_size=128), fitted=KNOWN)
    engine = Engine(profile, time_scale=0.0)
    engine.start()
    try:
        prompt, answer = 300, 40
        request = engine.submit([f" t{i}" for i in range(prompt)], answer)
        while not request.finished:
            await request.wait(request.generated)
    finally:
        await engine.stop()
    expected = KNOWN.step_seconds(0, 0, prompt) + sum(KNOWN.step_seconds(1, prompt + k, 0) for k in range(1, answer))
    assert engine.stats.steps == answer
    assert close(engine.stats.step_seconds, expected, 1e-9)


@pytest.mark.asyncio
async def test_a_request_reaches_the_queue_first_token_s_after_it_is_sent() -> None:
    slow = replace(make_profile(), fitted=StepModel(0.001, 0.0, 0.0, 0.0, first_token_s=0.5))
    engine = Engine(slow, time_scale=1.0)
    engine.start()
    try:
        request = engine.submit([" a", " b"], 2)
        await asyncio.sleep(0.05)
        assert (engine.num_waiting, engine.num_running, request.generated) == (0, 0, 0)  # still in "the API server"
        engine.abort(request)  # a client gone before the engine saw it: it never reaches the queue
        await asyncio.sleep(0.6)
        assert (engine.num_waiting, engine.num_running, engine.stats.steps) == (0, 0, 0)
        # Another one gets there and is answered.
        done = engine.submit([" c"], 1)
        while not done.finished:
            await done.wait(done.generated)
        assert done.first_token_at is not None and done.first_token_at - done.arrival >= 0.5
    finally:
        await engine.stop()


@pytest.mark.asyncio
async def test_a_busy_engine_takes_the_busy_first_token_latency() -> None:
    profile = replace(make_profile(), fitted=StepModel(0.001, 0.0, 0.0, 0.0, first_token_s=1.0, first_token_busy_s=0.05))
    engine = Engine(profile, time_scale=1.0)
    engine.start()
    try:
        long = engine.submit([" a"], 5000)  # idle engine: reaches the queue after 1 s, then runs for seconds
        await long.wait(0)
        assert long.first_token_at is not None and long.first_token_at - long.arrival >= 1.0
        short = engine.submit([" b"], 1)  # the engine is busy: 0.05 s
        while not short.finished:
            await short.wait(short.generated)
        assert short.first_token_at is not None and 0.05 <= short.first_token_at - short.arrival < 1.0
    finally:
        await engine.stop()


@pytest.mark.asyncio
async def test_the_server_with_a_profile_answers_at_the_fitted_step_time(tmp_path: Path) -> None:
    """The HTTP path with `--profile`: a completion of 200 prompt token ids and 30 answer tokens costs the engine
    exactly the fitted model's seconds (simulated: at time scale 0 nothing sleeps)."""
    path = tmp_path / "profile.json"
    calibrate.write(path, profile_document())
    args = build_parser().parse_args(["sim", "--served-model-name", MODEL, "--profile", str(path)])
    profile = build_profile(args)
    async with sim(profile=profile, time_scale=0.0) as s, aiohttp.ClientSession() as client:
        body = {"model": MODEL, "prompt": list(range(200)), "max_tokens": 30, "ignore_eos": True}
        async with client.post(s.url + "/v1/completions", json=body) as resp:
            assert resp.status == 200
            usage = (await resp.json())["usage"]
            assert (usage["prompt_tokens"], usage["completion_tokens"]) == (200, 30)
        async with client.get(s.url + "/metrics") as resp:
            text = await resp.text()
    fitted = profile.fitted
    assert fitted is not None
    expected = fitted.step_seconds(0, 0, 200) + sum(fitted.step_seconds(1, 200 + k, 0) for k in range(1, 30))
    assert close(s.engine.stats.step_seconds, expected, 1e-9)
    assert metric_value(text, contract.VLLM_METRIC_CACHE_CONFIG, block_size="128", num_gpu_blocks="64") == 1


@pytest.mark.asyncio
async def test_the_sim_process_takes_its_capacity_from_the_profile(tmp_path: Path) -> None:
    path = tmp_path / "profile.json"
    calibrate.write(path, profile_document(max_num_seqs=16))
    port = free_port()
    with spawn_sim(port, "--profile", str(path), "--time-scale", "0.01") as process:
        url = f"http://127.0.0.1:{port}"
        await wait_healthy(url)
        async with aiohttp.ClientSession() as client:
            async with client.get(url + "/metrics") as resp:
                text = await resp.text()
            async with client.get(url + "/v1/models") as resp:
                models = await resp.json()
        assert metric_value(text, contract.VLLM_METRIC_CACHE_CONFIG, block_size="128", num_gpu_blocks="64") == 1
        assert models["data"][0]["max_model_len"] == 2048
        assert process.poll() is None


# --- `tensorfleet sim calibrate` --------------------------------------------------------------------------------


def test_calibrate_is_a_word_after_sim_that_leaves_the_simulators_flags_alone() -> None:
    args = build_parser().parse_args(["sim", "calibrate", "--url", "http://e:8000", "-o", "p.json",
                                      "--concurrencies", "1,4", "--max-num-seqs", "8"])
    assert (args.url, args.output, args.concurrencies, args.max_num_seqs) == ("http://e:8000", "p.json", (1, 4), 8)
    assert args.func.__name__ == "calibrate"
    # The simulator keeps ignoring what it does not know, values included.
    plain = build_parser().parse_args(["sim", "--served-model-name", "m", "--gpu-memory-utilization", "0.9"])
    assert plain.ignored_args == ["--gpu-memory-utilization", "0.9"] and plain.func.__name__ == "run"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["sim", "calibrate", "--url", "http://e:8000", "-o", "p.json", "--bogus"])


def test_calibrate_says_in_one_line_when_there_is_no_engine(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match=r"^error: GET http://127\.0\.0\.1:\d+/v1/models: "):
        tensorfleet_main(["sim", "calibrate", "--url", f"http://127.0.0.1:{free_port()}", "-o",
                          str(tmp_path / "p.json")])
    assert not (tmp_path / "p.json").exists()


def test_calibrate_against_a_real_engine_writes_a_valid_profile(real_vllm: Any, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """A tiny sweep against the session's real vLLM (CPU, tiny model, max-model-len 2048): the profile holds the
    engine's identity and cache config as its /metrics gives them, every measurement, and a fit of non-negative
    constants that the simulator loads."""
    path = tmp_path / "profile.json"
    assert tensorfleet_main(["sim", "calibrate", "--url", real_vllm.url, "-o", str(path), "--concurrencies", "1,3",
                             "--contexts", "32,512", "--decode-tokens", "64", "--prompt-lengths", "16,512",
                             "--repeats", "1", "--prefill-repeats", "1", "--warmup", "1", "--sustained-seconds", "1",
                             "--time-limit", "400"]) == 0
    assert f"wrote {path}" in capsys.readouterr().out
    doc = json.loads(path.read_text())
    with urllib.request.urlopen(real_vllm.url + "/metrics", timeout=30) as answer:
        config, = promtext.select(answer.read().decode(), contract.VLLM_METRIC_CACHE_CONFIG)
    assert doc["engine"]["version"] == "0.19.1" and doc["engine"]["model"] == real_vllm.served_name
    assert doc["capacity"]["max_model_len"] == 2048
    assert (doc["capacity"]["block_size"], doc["capacity"]["num_gpu_blocks"]) == (
        int(config.labels["block_size"]), int(config.labels["num_gpu_blocks"]))
    assert [(p["prompt_tokens"], p["background"]) for p in doc["measurements"]["prefill"]] == [
        (16, 0), (16, 2), (512, 0), (512, 2)]
    assert all(p["background_context"] > 2 * 64 for p in doc["measurements"]["prefill"] if p["background"])
    assert doc["fit"]["first_token_busy_s"] is not None
    # Closed loops at a quarter (at least 1), half and all of the largest batch (3), timed by the engine's own steps.
    assert [p["concurrency"] for p in doc["measurements"]["sustained"]] == [1, 3], doc["notes"]
    assert all(p["steps"] > 0 and p["generated_tokens"] > 0 for p in doc["measurements"]["sustained"])
    assert {(p["concurrency"], p["prompt_tokens"]) for p in doc["measurements"]["decode"]} == {
        (1, 32), (3, 32), (1, 512), (3, 512)}, doc["notes"]
    assert all(p["itl_s"] > 0 for p in doc["measurements"]["decode"])
    calibration = load(path)
    assert calibration.step.step_seconds(1, 100, 0) > 0
    assert calibration.profile().fitted == calibration.step



@pytest.mark.asyncio
async def test_a_decode_point_sent_in_one_merged_event_is_taken_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine whose HTTP side was starved while it decoded (as on a busy host) sends a request's tokens in one
    merged event: that try has no window, and the point is taken again rather than dropped."""
    merged: list[int] = []
    stream = probe.CalibrationClient.stream

    async def starved(self: Any, tokens: int, max_tokens: int, marks: Any = None) -> Any:
        got = await stream(self, tokens, max_tokens, marks)
        if max_tokens == sweep.decode_tokens and tokens not in merged:
            merged.append(tokens)  # the first request of each point: all its tokens at once, at its end
            got[:] = [(got[-1][0], got[-1][1])]
        return got

    monkeypatch.setattr(probe.CalibrationClient, "stream", starved)
    sweep = Sweep(concurrencies=(1,), contexts=(32, 96), decode_tokens=16, prompt_lengths=(16,), repeats=1,
                  prefill_repeats=1, sustained_s=0.0, warmup=0, time_limit_s=60.0)
    async with sim(profile=make_profile(max_num_batched_tokens=BUDGET), time_scale=0.02) as s:
        doc = await probe.measure(s.url, MODEL, sweep)
    assert merged == [32, 96]
    assert [p["prompt_tokens"] for p in doc["measurements"]["decode"]] == [32, 96], doc["notes"]
    assert not [n for n in doc["notes"] if "no window" in n]


@pytest.mark.asyncio
async def test_busy_prefill_points_are_measured_while_the_background_turns_over(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine that decodes a whole context window in well under the probes' time (a short max-model-len): its
    background requests finish and are restarted during the busy prefill point, and every probe is still taken
    with both of them decoding (a probe they turned over in is sent again), none dropped."""
    started: list[int] = []
    stream = probe.CalibrationClient.stream

    async def counted(self: Any, tokens: int, max_tokens: int, marks: Any = None) -> Any:
        if max_tokens > sweep.decode_tokens:
            started.append(tokens)
        return await stream(self, tokens, max_tokens, marks)

    monkeypatch.setattr(probe.CalibrationClient, "stream", counted)
    profile = make_profile(max_model_len=160, max_num_batched_tokens=BUDGET)
    sweep = Sweep(concurrencies=(1,), contexts=(32,), decode_tokens=8, prompt_lengths=(16, 48), repeats=1,
                  prefill_repeats=12, probe_pause_s=0.05, sustained_s=0.0, warmup=0, time_limit_s=60.0)
    async with sim(profile=profile, time_scale=0.02) as s:
        doc = await probe.measure(s.url, MODEL, sweep)
    busy = [p for p in doc["measurements"]["prefill"] if p["background"]]
    assert [p["prompt_tokens"] for p in busy] == [16, 48], doc["notes"]
    assert all(len(p["samples"]) == 12 and p["background_context"] > 2 * probe.BACKGROUND_PROMPT for p in busy)
    # The background turned over: more background requests than the two each busy point starts.
    assert set(started) == {probe.BACKGROUND_PROMPT} and len(started) > 4


@pytest.mark.asyncio
async def test_a_completion_whose_connection_closes_before_any_answer_is_sent_once_more() -> None:
    """An engine closes a pooled connection just as the calibration reuses it (its keep-alive clock ran out first):
    nothing reached it, so the completion goes once more on a new connection; a second such failure, or one after
    the answer began, is an error."""
    chunks = [{"choices": [{"text": "a"}], "usage": {"completion_tokens": n}} for n in (1, 3)]
    answer = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n" + b"".join(
        b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"
    plan: list[bytes | None] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        step = plan.pop(0) if plan else None
        if step is not None:
            writer.write(step)
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server, aiohttp.ClientSession() as session:
        client = probe.CalibrationClient(session, f"http://127.0.0.1:{port}", MODEL, {}, 10.0, random.Random(0))
        plan[:] = [None, answer]
        assert [n for _, n in await client.stream(4, 3)] == [1, 3] and not plan
        plan[:] = [None, None, answer]
        with pytest.raises(CalibrationError, match="ServerDisconnectedError"):
            await client.stream(4, 3)
        first_event = answer.index(b"\n\n", answer.index(b"data: ")) + 2
        cut = answer[:first_event].replace(b"connection: close", b"content-length: 1000")
        plan[:] = [cut, answer]
        with pytest.raises(CalibrationError, match="ClientPayloadError"):
            await client.stream(4, 3)
        assert plan == [answer]
