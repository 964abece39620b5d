"""Prefill/decode disaggregation: two pools of one model, planned apart and checked to exchange KV.
`plan_disaggregated` (which `entry.make_plan` sends a spec with spec.prefill) plans the decode pool from the spec's
own parallelism and accelerator and the prefill pool from spec.prefill, each as a pool of its own, and refuses what
would keep their engines from exchanging KV. Design: docs/disaggregation.md#what-the-planner-checks."""

from __future__ import annotations

from dataclasses import replace

from tensorfleet import contract
from tensorfleet.api.errors import SpecError
from tensorfleet.api.models import InferenceServiceSpec, ParallelismSpec
from tensorfleet.catalog import ModelFacts, is_cpu
from tensorfleet.engine_settings import BY_FIELD, vllm_flag_name
from tensorfleet.planner.plan import Plan, plan_pool

PREFILL = "spec.prefill"
KV_TRANSFER_FLAG = BY_FIELD["kv_transfer_config"].vllm_flag
# A field of the decode pool's spec, as an error about the prefill pool must name it.
_RENAMED = (("spec.parallelism", f"{PREFILL}.parallelism"), ("spec.accelerator", f"{PREFILL}.accelerator"))


def plan_disaggregated(spec: InferenceServiceSpec, facts: ModelFacts | None = None) -> Plan:
    """Plan a spec with spec.prefill: its decode pool carrying the prefill pool's plan. Raises SpecError naming
    the field."""
    prefill = spec.prefill
    if prefill is None:
        raise ValueError("plan_disaggregated plans a spec with spec.prefill; make_plan plans one without")
    if spec.adapters or spec.engine.lora is not None:
        raise SpecError("spec.adapters", "LoRA adapters are not served by disaggregated pools yet; remove "
                                         "spec.adapters and spec.engine.lora, or spec.prefill")
    for field, accelerator in (("spec.accelerator", spec.accelerator), (f"{PREFILL}.accelerator", prefill.accelerator)):
        if accelerator is not None and is_cpu(accelerator.type):
            raise SpecError(f"{field}.type", f"{accelerator.type}: disaggregated pools run on GPU types (their KV moves "
                                             "between GPUs over NIXL); vLLM's CPU backend serves colocated engines, "
                                             "without spec.prefill")
    for index, item in enumerate(spec.engine.args):
        if vllm_flag_name(item) == KV_TRANSFER_FLAG:
            raise SpecError(f"spec.engine.args[{index}]",
                            f"{item[:60]!r}: with spec.prefill the operator sets {KV_TRANSFER_FLAG} on both pools; "
                            "choose the connector with spec.kvTransfer.connector")
    for field, parallelism in (("spec.parallelism", spec.parallelism), (f"{PREFILL}.parallelism", prefill.parallelism)):
        if parallelism.pipeline not in (None, 1):
            raise SpecError(f"{field}.pipeline", f"{parallelism.pipeline} stages: with spec.prefill both pools run "
                                                 "single-stage engines (tensor parallelism only, up to a node's GPUs); "
                                                 "set pipeline 1 or a larger GPU type")
    single = ParallelismSpec(tensor=spec.parallelism.tensor, pipeline=1)
    decode = plan_pool(spec.model_copy(update={"parallelism": single, "prefill": None}), facts, kv_connector=True)
    prefill_spec = spec.model_copy(update={
        "parallelism": ParallelismSpec(tensor=prefill.parallelism.tensor, pipeline=1),
        "accelerator": prefill.accelerator or spec.accelerator, "prefill": None, "autoscaling": None,
    })
    try:
        pool = plan_pool(prefill_spec, facts, kv_connector=True)
    except SpecError as exc:
        raise _renamed(exc) from None
    if pool.dtype != decode.dtype:
        raise SpecError(f"{PREFILL}.accelerator.type",
                        f"the prefill pool would compute in {pool.dtype} on {pool.accelerator} and the decode pool in "
                        f"{decode.dtype} on {decode.accelerator}: their KV caches could not be exchanged; choose GPU "
                        f"types that both run {decode.dtype}, or set spec.model.dtype: float16")
    if pool.kv_cache_dtype != decode.kv_cache_dtype:
        raise SpecError(f"{PREFILL}.accelerator.type",
                        f"the prefill pool's KV cache would hold {pool.kv_cache_dtype} and the decode pool's "
                        f"{decode.kv_cache_dtype}: they could not be exchanged")
    connector = spec.kv_transfer.connector if spec.kv_transfer is not None else contract.DEFAULT_KV_CONNECTOR
    return _with(decode, pool, connector)


def _with(decode: Plan, prefill: Plan, connector: str) -> Plan:
    return replace(decode, prefill=replace(prefill, kv_connector=connector), kv_connector=connector)


def _renamed(exc: SpecError) -> SpecError:
    for old, new in _RENAMED:
        if exc.field == old or exc.field.startswith(old + "."):
            return SpecError(new + exc.field[len(old):], exc.message)
    return exc
