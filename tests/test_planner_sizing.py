"""Sizing a fleet for a workload and latency targets (planner/sizing.py, `tensorfleet plan --rate/--users`)."""

from __future__ import annotations

import json
import math

import pytest
import yaml
from conftest import isvc_doc

from tensorfleet.api.models import InferenceServiceSpec
from tensorfleet.cli import main
from tensorfleet.planner import make_plan, sizing
from tensorfleet.sim.profile import make_profile

MODEL = "meta-llama/Llama-3.1-70B-Instruct"
SEED = ["--users", "10000", "--prompt-tokens", "500", "--output-tokens", "200", "--ttft-p99", "2", "--itl-p99", "0.1"]


def _engines(decode_gpu: str = "H100-80GB", prefill_gpu: str = "H100-80GB") -> tuple[sizing.Engine, sizing.Engine]:
    spec = InferenceServiceSpec.model_validate({
        "model": {"name": MODEL, "maxModelLen": 8192}, "accelerator": {"type": decode_gpu}, "parallelism": {"tensor": 4},
        "prefill": {"accelerator": {"type": prefill_gpu}, "parallelism": {"tensor": 4}}})
    plan = make_plan(spec)
    assert plan.prefill is not None
    arch = sizing.model_arch(spec, None)
    assert arch is not None
    return sizing.engine_for(plan, arch), sizing.engine_for(plan.prefill, arch)


def _size(rate: float = 200.0, ttft: float = 2.0, itl: float = 0.1) -> sizing.Sizing:
    decode, prefill = _engines()
    return sizing.size(sizing.Workload(500, 200, rate=rate), sizing.Targets(ttft, itl), decode, prefill)


def test_decode_step_matches_the_simulator() -> None:
    decode, _ = _engines()
    profile = make_profile(MODEL, "H100-80GB", tensor=4, max_model_len=8192, kv_cache_tokens=decode.kv_cache_tokens)
    # The same roofline figures: bandwidth, FLOPs, overhead.
    assert decode.bandwidth_bytes_per_s == profile.bandwidth_bytes_per_s
    assert decode.flops_per_s == profile.flops_per_s
    assert decode.flops_per_token_per_gpu == pytest.approx(profile.flops_per_token_per_gpu)
    assert decode.overhead_s == profile.overhead_s
    assert decode.kv_bytes_per_token_per_gpu == profile.kv_bytes_per_token_per_gpu
    for batch, context, prefill in ((1, 512, 0), (64, 64 * 600, 0), (512, 512 * 600, 0), (200, 200 * 600, 768),
                                    (0, 0, 2048)):
        # The planner's weights come from the per-layer facts, the simulator's from the totals: within 0.5%.
        assert decode.step_seconds(batch, context, prefill) == pytest.approx(
            profile.step_seconds(batch, context, prefill), rel=0.005)
    # Fed the simulator's own inputs, the planner's step is the simulator's, to the bit.
    same = sizing.Engine(accelerator="H100-80GB", tensor=4, gpus=4,
                         weight_bytes_per_gpu=float(profile.weight_bytes_per_gpu),
                         kv_bytes_per_token_per_gpu=float(profile.kv_bytes_per_token_per_gpu),
                         kv_cache_tokens=profile.kv_cache_tokens, max_num_seqs=profile.max_num_seqs,
                         max_num_batched_tokens=profile.max_num_batched_tokens,
                         bandwidth_bytes_per_s=profile.bandwidth_bytes_per_s, flops_per_s=profile.flops_per_s,
                         flops_per_token_per_gpu=profile.flops_per_token_per_gpu, overhead_s=profile.overhead_s)
    for batch in (1, 7, 100, 700):
        assert same.step_seconds(batch, batch * 650, 0) == profile.step_seconds(batch, batch * 650, 0)


def test_moe_weights_read_match_the_simulator() -> None:
    spec = InferenceServiceSpec.model_validate({"model": {"name": "Qwen/Qwen3-30B-A3B", "maxModelLen": 8192},
                                                "accelerator": {"type": "H100-80GB"}, "parallelism": {"tensor": 1}})
    arch = sizing.model_arch(spec, None)
    if arch is None or arch.moe is None:
        pytest.skip("no MoE model of that name in the catalog")
    engine = sizing.engine_for(make_plan(spec), arch)
    profile = make_profile("Qwen/Qwen3-30B-A3B", "H100-80GB", tensor=1, max_model_len=8192)
    for batch in (1, 8, 64):
        assert engine.weight_bytes_read(batch) / engine.weight_bytes_per_gpu == pytest.approx(
            profile.weight_bytes_read(batch) / profile.weight_bytes_per_gpu)


def test_more_rate_needs_no_fewer_replicas() -> None:
    previous: tuple[int, int, int] | None = None
    for rate in (5.0, 50.0, 200.0, 800.0, 2000.0):
        result = _size(rate)
        prefill, decode = result.disaggregated.pools
        counts = (result.colocated[0].pools[0].replicas, prefill.replicas, decode.replicas)
        if previous is not None:
            assert all(now >= before for now, before in zip(counts, previous, strict=True)), (rate, counts, previous)
        previous = counts


def test_tighter_ttft_needs_no_fewer_prefill_replicas() -> None:
    counts = [_size(400.0, ttft=ttft).disaggregated.pools[0].replicas for ttft in (5.0, 2.0, 1.0, 0.5, 0.3)]
    assert counts == sorted(counts)
    assert counts[-1] > counts[0]


def test_tighter_itl_gives_no_larger_decode_batch() -> None:
    decode, _ = _engines()
    workload = sizing.Workload(500, 200, rate=100.0)
    caps = [sizing.decode_cap(decode, workload, itl) for itl in (0.2, 0.1, 0.05, 0.03, 0.02, 0.015)]
    assert caps == sorted(caps, reverse=True)
    assert caps[0] > caps[-1]
    # Beside a prefill chunk the batch that meets the same ITL is smaller: the interference.
    assert sizing.decode_cap(decode, workload, 0.1, chunk=1024) < sizing.decode_cap(decode, workload, 0.1)
    # An ITL below one step at batch 1 admits no batch at all.
    assert sizing.decode_cap(decode, workload, 0.005) == 0
    assert not _size(itl=0.005).disaggregated.feasible


def test_erlang_c_wait() -> None:
    assert sizing.erlang_c(1, 0.5) == pytest.approx(0.5)        # M/M/1: P(wait) = rho
    assert sizing.wait_p99(1, 0.5, 1.0) == pytest.approx(math.log(50) / 0.5)
    assert sizing.wait_p99(10, 1.0, 1.0) == 0.0                 # hardly anyone waits
    assert sizing.wait_p99(2, 3.0, 1.0) == math.inf             # overloaded
    assert sizing.mean_batch(640) + 2.326 * math.sqrt(sizing.mean_batch(640)) <= 640


def test_seed_exercise_on_h100() -> None:
    decode, prefill = _engines()
    result = sizing.size(sizing.Workload(500, 200, users=10000), sizing.Targets(2.0, 0.1), decode, prefill)
    assert result.choice in ("colocated", "disaggregated")
    assert result.chosen is not None and result.why
    for layout in (*result.colocated, result.disaggregated):
        assert layout.feasible and 0 < layout.gpus < 10_000
        assert layout.ttft_p99 <= 2.0 and layout.itl_p99 <= 0.1
        assert layout.rate == result.disaggregated.rate      # compared at one rate
    # 10,000 users with no think time keep about 10,000 answers decoding.
    _, decode_pool = result.disaggregated.pools
    assert decode_pool.replicas * decode_pool.decode_batch >= 0.8 * 10000
    assert result.chosen.gpus == min(x.gpus for x in (*result.colocated, result.disaggregated))


def test_seed_exercise_mixed_fleet() -> None:
    decode, prefill = _engines("A100-80GB", "H100-80GB")
    result = sizing.size(sizing.Workload(500, 200, users=10000), sizing.Targets(2.0, 0.1), decode, prefill,
                         colocated=(decode, prefill))
    assert {x.pools[0].accelerator for x in result.colocated} == {"A100-80GB", "H100-80GB"}
    split = result.disaggregated
    assert split.feasible
    assert [(p.role, p.accelerator) for p in split.pools] == [("prefill", "H100-80GB"), ("decode", "A100-80GB")]
    assert set(split.gpus_by_type()) == {"A100-80GB", "H100-80GB"}
    assert result.choice in ("colocated", "disaggregated")


def test_think_time_lowers_the_rate() -> None:
    decode, prefill = _engines()
    busy = sizing.size(sizing.Workload(500, 200, users=1000), sizing.Targets(2.0, 0.1), decode, prefill)
    idle = sizing.size(sizing.Workload(500, 200, users=1000, think_seconds=60), sizing.Targets(2.0, 0.1), decode, prefill)
    assert idle.disaggregated.rate < busy.disaggregated.rate
    assert idle.disaggregated.gpus <= busy.disaggregated.gpus


@pytest.mark.parametrize("workload, flag", [
    (sizing.Workload(500, 200), "--rate"),
    (sizing.Workload(500, 200, rate=1.0, users=3), "--rate"),
    (sizing.Workload(500, 200, rate=-1.0), "--rate"),
    (sizing.Workload(0, 200, rate=1.0), "--prompt-tokens"),
    (sizing.Workload(500, 200, users=0), "--users"),
])
def test_bad_workloads_name_the_flag(workload: sizing.Workload, flag: str) -> None:
    with pytest.raises(sizing.SizingError) as caught:
        workload.check()
    assert caught.value.field == flag


# --- the command ------------------------------------------------------------------


def _manifest(tmp_path, accelerator: str = "H100-80GB", **spec: object) -> str:  # type: ignore[no-untyped-def]
    doc = isvc_doc({"model": {"name": MODEL, "maxModelLen": 8192}, "accelerator": {"type": accelerator},
                    "parallelism": {"tensor": 4}, **spec})
    path = tmp_path / "isvc.yaml"
    path.write_text(yaml.safe_dump(doc))
    return str(path)


def test_plan_json_stays_one_object_with_sizing(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["plan", "-f", _manifest(tmp_path), "--offline", "-o", "json", *SEED]) == 0
    out = capsys.readouterr().out
    document = json.loads(out)            # one object, nothing after it
    assert isinstance(document, dict)
    sized = document["sizing"]
    assert sized["choice"] in ("colocated", "disaggregated")
    assert sized["disaggregated"]["pools"][0]["role"] == "prefill"
    assert sized["colocated"][0]["gpus"] > 0


def test_plan_mixed_fleet_from_the_flag(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    path = _manifest(tmp_path, "A100-80GB")
    assert main(["plan", "-f", path, "--offline", "-o", "json", "--prefill-accelerator", "H100", *SEED]) == 0
    sized = json.loads(capsys.readouterr().out)["sizing"]
    assert [p["accelerator"] for p in sized["disaggregated"]["pools"]] == ["H100-80GB", "A100-80GB"]
    assert len(sized["colocated"]) == 2


def test_plan_sizes_the_manifests_prefill_pool(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    path = _manifest(tmp_path, "A100-80GB", prefill={"accelerator": {"type": "H100-80GB"}, "parallelism": {"tensor": 4}})
    assert main(["plan", "-f", path, "--offline", *SEED]) == 0
    out = capsys.readouterr().out
    assert "prefill pool" in out and "  sizing" in out
    assert "on H100-80GB + decode" in out and "choice" in out


def test_plan_without_flags_is_unchanged(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    path = _manifest(tmp_path)
    assert main(["plan", "-f", path, "--offline", "-o", "json"]) == 0
    assert "sizing" not in json.loads(capsys.readouterr().out)
    assert main(["plan", "-f", path, "--offline"]) == 0
    assert "sizing" not in capsys.readouterr().out


@pytest.mark.parametrize("extra, flag", [
    (["--prompt-tokens", "500"], "--rate"),
    (["--rate", "10", "--prompt-tokens", "500", "--output-tokens", "200", "--ttft-p99", "2"], "--itl-p99"),
    (["--rate", "0", "--prompt-tokens", "500", "--output-tokens", "200", "--ttft-p99", "2", "--itl-p99", "0.1"],
     "--rate"),
    (["--rate", "10", "--prompt-tokens", "500", "--output-tokens", "200", "--ttft-p99", "-1", "--itl-p99", "0.1"],
     "--ttft-p99"),
    (["--rate", "10", "--think-seconds", "3", "--prompt-tokens", "5", "--output-tokens", "2", "--ttft-p99", "1",
      "--itl-p99", "0.1"], "--think-seconds"),
    ([*SEED, "--prefill-accelerator", "H100-40GB"], "--prefill-accelerator"),
    ([*SEED, "--kv-transfer-gbps", "0"], "--kv-transfer-gbps"),
])
def test_bad_flags_are_one_line_errors(tmp_path, capsys, extra: list[str], flag: str) -> None:  # type: ignore[no-untyped-def]
    assert main(["plan", "-f", _manifest(tmp_path), "--offline", *extra]) != 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and flag in err, err


def test_rate_and_users_exclude_one_another(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(SystemExit) as caught:
        main(["plan", "-f", _manifest(tmp_path), "--rate", "1", "--users", "2"])
    assert caught.value.code != 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--users" in err
