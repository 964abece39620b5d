"""`tensorfleet`: plan, render and inspect InferenceServices from the command line, with the same pure planner and
renderer the operator and the webhook run. Every user mistake ends as one line on stderr and a non-zero exit;
tracebacks are for bugs only. Design: docs/architecture.md#layers-one-way-only."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, NoReturn

import yaml

from tensorfleet import contract
from tensorfleet.api import InferenceService, SpecError, load_inference_service
from tensorfleet.api.crd import crd
from tensorfleet.api.errors import one_line
from tensorfleet.api.manifest import MAX_INPUT_BYTES, ManifestError, parse_manifests
from tensorfleet.catalog import GPUS, MODELS, ModelFacts
from tensorfleet.extras import MissingExtra
from tensorfleet.planner import Plan, make_plan, sizing
from tensorfleet.planner.memory import GiB, MiB, cuda_total_bytes
from tensorfleet.planner.plan import CPU_MEMORY_FIELD

EXIT_INVALID = 1
EXIT_USAGE = 2
EXIT_MISSING_EXTRA = 1  # a command whose extra is not installed, like any other failure to start


class UsageError(Exception):
    """Bad input that is not a spec problem (missing file, unreadable YAML)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # argparse prints the whole usage block; one line says the same.
        sys.stderr.write(f"error: {message} (see `{self.prog} --help`)\n")
        raise SystemExit(EXIT_USAGE)


def _read_input(path: str) -> tuple[str, bytes]:
    """(label, bytes) of FILE or stdin ('-'), reading at most one byte past the input limit."""
    limit = MAX_INPUT_BYTES + 1
    if path == "-":
        stream = getattr(sys.stdin, "buffer", None)
        data = stream.read(limit) if stream is not None else sys.stdin.read(limit).encode("utf-8", "surrogateescape")
        return "<stdin>", data
    file = Path(path)
    try:
        with file.open("rb") as handle:   # a pipe such as -f <(...) too
            return path, handle.read(limit)
    except FileNotFoundError:
        raise UsageError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise UsageError(f"{path}: is a directory; name one YAML file (or - for stdin)") from None
    except OSError as exc:
        raise UsageError(f"{path}: cannot read: {exc.strerror or exc}") from None


def _read_documents(path: str) -> list[tuple[str, Any]]:
    """(label, document) for each non-empty YAML document of FILE or stdin ('-'), within api/manifest.py's bounds."""
    label, data = _read_input(path)
    try:
        return parse_manifests(data, label)
    except ManifestError as exc:
        raise UsageError(str(exc)) from None


# The model facts for an InferenceService, and a note saying why there are none (see _model_facts).
FactsFor = Callable[[InferenceService], tuple[ModelFacts | None, str | None]]


def _load(path: str, facts_for: FactsFor | None = None) -> list[tuple[str, InferenceService, Plan]]:
    out = []
    for label, document in _read_documents(path):
        note: str | None = None
        try:
            # Checked as the API server will check it (strict field validation), then planned.
            isvc = load_inference_service(document, strict=True)
            facts, note = facts_for(isvc) if facts_for else (None, None)
            plan = make_plan(isvc.spec, facts)
            out.append((label, isvc, replace(plan, notes=(*plan.notes, note)) if note else plan))
        except SpecError as exc:
            raise UsageError(f"{label}: {exc}" + (f" ({note})" if note else "")) from None
    return out


def _replicas(isvc: InferenceService) -> int:
    spec = isvc.spec
    if spec.replicas is not None:
        return spec.replicas
    return spec.autoscaling.min_replicas if spec.autoscaling else 1


def plan_summary(isvc: InferenceService, plan: Plan) -> dict[str, Any]:
    """The machine-readable plan: `status.plan` plus the sizing behind it."""
    replicas = _replicas(isvc)
    return {
        "name": isvc.name,
        "namespace": isvc.namespace,
        "model": plan.model,
        **plan.to_status().model_dump(by_alias=True),
        "allocation": None if plan.cpu else isvc.spec.accelerator.allocation,
        "autoLayout": plan.auto_layout,
        "dtype": plan.dtype,
        "engineDtype": plan.engine_dtype,
        "weightFormat": plan.weight_format,
        "kvCacheDtype": plan.kv_cache_dtype,
        "gpuMemoryBytes": plan.gpu_memory_bytes,
        "budgetBytesPerGPU": plan.budget_bytes_per_gpu,
        "weightBytesTotal": plan.weight_bytes_total,
        "weightBytesPerGPU": plan.weight_bytes_per_gpu,
        "activationBytesPerGPU": plan.activation_bytes_per_gpu,
        "nonTorchBytesPerGPU": plan.non_torch_bytes_per_gpu,
        "kvCacheBytesPerGPU": plan.kv_bytes_per_gpu,
        **({} if plan.lora is None else {
            "loraSlotBytesPerGPU": plan.lora.weight_bytes_per_gpu,
            "loraWorkingBytesPerGPU": plan.lora.working_bytes_per_gpu,
            "loraRankAssumed": plan.lora.rank_assumed,
        }),
        "maxConcurrency": round(plan.max_concurrency, 2),
        "kvCacheGroups": [spec.kind + (f":{spec.window}" if spec.window else "") for spec in plan.kv_pool.specs],
        "kvCacheBlocks": plan.kv_pool.num_blocks,
        "kvCacheBlockSize": plan.kv_pool.block_size,
        "vllmArithmetic": contract.VLLM_VERSION,
        "maxNumSeqs": plan.max_num_seqs,
        "replicas": replicas,
        "totalGPUs": replicas * plan.gpus_per_replica,
        "modelRevision": plan.model_revision,
        "weightDetail": plan.weight_detail,
        "notes": list(plan.notes),
        **({} if plan.prefill is None or isvc.spec.prefill is None else {"prefill": {
            **plan.prefill.to_status().model_dump(by_alias=True),
            "replicas": isvc.spec.prefill.replicas,
            "totalGPUs": isvc.spec.prefill.replicas * plan.prefill.gpus_per_replica,
            "kvConnector": plan.kv_connector,
        }}),
    }


def _gib(value: int) -> str:
    return f"{value / GiB:.1f} GiB"


def _size(value: int) -> str:
    """GiB, or MiB below one GiB (LoRA figures are often a few hundred MiB)."""
    if value >= GiB:
        return _gib(value)
    return f"{value / MiB:.0f} MiB" if value >= 10 * MiB else f"{value / MiB:.1f} MiB"


def _lora_rows(plan: Plan) -> list[tuple[str, str]]:
    """The LoRA slots and working buffers, which come out of the KV cache (none without LoRA)."""
    lora = plan.lora
    if lora is None:
        return []
    return [
        ("  LoRA slots", (f"{_size(lora.weight_bytes_per_gpu)} per GPU ({lora.max_loras} x rank {lora.max_rank}; "
                          f"host memory holds {lora.max_cpu_loras})")),
        ("  LoRA working", f"{_size(lora.working_bytes_per_gpu)} per GPU (fp32 buffers of the profiling pass)"),
    ]


def _prefill_rows(isvc: InferenceService, plan: Plan) -> list[tuple[str, str]]:
    """With spec.prefill: the prefill pool beside the decode pool the rows above describe."""
    pool, spec = plan.prefill, isvc.spec.prefill
    if pool is None or spec is None:
        return []
    return [
        ("prefill pool", (f"{spec.replicas} x tensor {pool.tensor} on {pool.accelerator} "
                          f"({spec.replicas * pool.gpus_per_replica} GPUs; the rows above are the decode pool)")),
        ("  weights", f"{_gib(pool.weight_bytes_per_gpu)} per GPU"),
        ("  KV cache size", f"{pool.kv_cache_tokens:,} tokens per engine"),
        ("kv transfer", f"{plan.kv_connector} (kv_role kv_both, side channel port {contract.NIXL_SIDE_CHANNEL_PORT})"),
    ]


def _device_rows(isvc: InferenceService, plan: Plan) -> list[tuple[str, str]]:
    """What one replica runs on: GPUs of a type, and how its pods get them; or on CPU the engine container's
    memory request."""
    if plan.cpu:
        return [
            ("accelerator", f"{plan.accelerator} (vLLM's CPU backend; {_gib(plan.gpu_memory_bytes)} memory request)"),
            ("layout", "tensor 1 x pipeline 1: one engine pod per replica, no GPU"),
        ]
    if isvc.spec.accelerator.allocation == contract.ALLOCATION_DEVICE_CLASS:
        allocation = (f"a ResourceClaim per pod: {plan.tensor} device(s) of the operator's DeviceClass (default "
                      f"{contract.DEFAULT_GPU_DEVICE_CLASS}) that are a {plan.accelerator} by productName and memory "
                      "(Dynamic Resource Allocation)")
    else:
        allocation = (f"{plan.tensor} {contract.GPU_RESOURCE} per pod (the device plugin), on nodes labelled "
                      f"{plan.accelerator}" + ("" if isvc.spec.accelerator.node_affinity == "auto" else
                                               " (not required: nodeAffinity none)"))
    return [
        ("accelerator", f"{plan.accelerator} ({plan.gpu_memory_bytes // MiB} MiB, {_gib(cuda_total_bytes(plan.gpu_memory_bytes))} usable by CUDA)"),
        ("layout", f"tensor {plan.tensor} x pipeline {plan.pipeline} = {plan.gpus_per_replica} GPU(s) per replica"
                   + (" (chosen by the planner)" if plan.auto_layout else "")),
        ("GPUs from", allocation),
    ]


def _kv_groups(plan: Plan) -> str:
    """How vLLM groups the layers, where it matters: several groups (sliding, chunked or state layers beside full
    ones)."""
    specs = plan.kv_pool.specs
    if len(specs) == 1 and specs[0].kind == "full":
        return ""
    names = {"mamba": "state"}
    kinds = ", ".join(f"{specs.count(spec)} {names.get(spec.kind, spec.kind)}"
                      + (f" ({spec.window:,}-token)" if spec.window else "") for spec in dict.fromkeys(specs))
    return (f" ({len(specs)} KV-cache groups: {kinds}; the pool as if every group held attention blocks, as vLLM "
            "logs it)")


def _state_rows(plan: Plan) -> list[tuple[str, str]]:
    """A hybrid model's state layers: the attention block vLLM raises to hold a state, and the state's page."""
    if not plan.state_bytes_per_gpu:
        return []
    pool, page = plan.kv_pool, plan.state_page_bytes
    modes = {spec.state_cache for spec in pool.specs if spec.kind == "mamba"}
    how = (" per block of tokens (prefix caching)" if "all" in modes else
           ", and its aligned copy (prefix caching)" if "align" in modes else "")
    return [("KV block", (f"{pool.block_size:,} tokens (vLLM raises the block from 16 so an attention page holds a "
                          f"state layer's {plan.state_bytes_per_gpu / MiB:.2f} MiB state; state pages padded "
                          f"{100 * (page / plan.state_bytes_per_gpu - 1):.2f}%)")),
            ("state per request", f"one {page / MiB:.2f} MiB page in each state group{how}")]


def plan_table(isvc: InferenceService, plan: Plan) -> str:
    replicas = _replicas(isvc)
    per_token = plan.kv_bytes_per_token_per_gpu
    typical = min(isvc.spec.router.typical_request_tokens, plan.max_model_len)
    per = "per pod" if plan.cpu else "per GPU"
    rows = [
        ("model", plan.model),
        *_device_rows(isvc, plan),
        ("precision", (f"weights {plan.weight_format}, activations {plan.dtype} (--dtype {plan.engine_dtype}), "
                       f"KV cache {plan.kv_cache_dtype}")),
        ("model facts", plan.model_source + (f" (config.json at {plan.model_revision[:12]})" if plan.model_revision else "")),
        ("weight format", plan.weight_detail or plan.weight_format),
        ("max model len", f"{plan.max_model_len:,} tokens"),
        ("memory budget", f"{_gib(plan.budget_bytes_per_gpu)} {per}"),
        ("  weights", f"{_gib(plan.weight_bytes_per_gpu)} {per} ({_gib(plan.weight_bytes_total)} in all)"),
        ("  activations", f"{_gib(plan.activation_bytes_per_gpu)} {per} ({'one step' if plan.cpu else 'profiling'} peak)"),
        (("  vLLM processes", f"{_gib(plan.non_torch_bytes_per_gpu)} per pod (API server, engine core)") if plan.cpu else
         ("  non-torch", f"{_gib(plan.non_torch_bytes_per_gpu)} per GPU (CUDA context, NCCL)")),
        *_lora_rows(plan),
        ("  KV cache", f"{_gib(plan.kv_bytes_per_gpu)} {per}" + (" (what the LoRA slots leave)" if plan.lora else "")
                       + (f" ({contract.ENV_CPU_KVCACHE_SPACE}={plan.cpu_kv_cache_gib})" if plan.cpu else "")),
        ("KV per token", f"{per_token / 1024:.1f} KiB {per}"),
        ("KV cache size", f"{plan.kv_cache_tokens:,} tokens per replica" + _kv_groups(plan)),
        *_state_rows(plan),
        ("max concurrency", (f"{plan.max_concurrency:.2f}x sequences of {plan.max_model_len:,} tokens "
                             f"({plan.max_concurrent_sequences} full-length at once); at the router's typical "
                             f"{typical:,} tokens {plan.kv_pool.concurrency(typical):.2f}x")),
        ("arithmetic", f"vLLM {contract.VLLM_VERSION}'s (the default engine image's profiling and KV-cache manager)"),
        ("max num seqs", str(plan.max_num_seqs)),
        ("replicas", f"{replicas} ({'no' if plan.cpu else replicas * plan.gpus_per_replica} GPUs)"
                     + (f", autoscaling {isvc.spec.autoscaling.min_replicas}-{isvc.spec.autoscaling.max_replicas}"
                        if isvc.spec.autoscaling else "")),
    ]
    rows += _prefill_rows(isvc, plan)
    rows += [("note", note) for note in plan.notes]
    width = max(len(key) for key, _ in rows)
    lines = [f"InferenceService {isvc.namespace}/{isvc.name}"]
    lines += [f"  {key.ljust(width)}  {value}" for key, value in rows]
    return "\n".join(lines)


def _model_facts(args: argparse.Namespace) -> FactsFor:
    """`plan`'s model facts: --model-config FILE, else the model's config.json through tensorfleet.modelinfo
    (the Hub unless --offline or HF_HUB_OFFLINE, then the local Hugging Face cache), else none: the catalog."""
    from tensorfleet import modelinfo

    given: ModelFacts | None = None
    if args.model_config:
        try:
            given = modelinfo.read_model_config(args.model_config)
        except modelinfo.ModelInfoError as exc:
            raise UsageError(f"--model-config: {exc}") from None

    def facts_for(isvc: InferenceService) -> tuple[ModelFacts | None, str | None]:
        model = isvc.spec.model
        if model.architecture is not None:
            return None, None
        if given is not None:
            return replace(given, name=model.name), None
        try:
            return modelinfo.resolve_model(model.name, model.revision, offline=True if args.offline else None), None
        except modelinfo.ModelInfoError as exc:
            return None, f"model facts from the catalog: {exc}"

    return facts_for


SIZING_FLAGS = ("rate", "users", "think_seconds", "prompt_tokens", "output_tokens", "ttft_p99", "itl_p99",
                "prefill_accelerator", "kv_transfer_gbps")


def _workload(args: argparse.Namespace) -> tuple[sizing.Workload, sizing.Targets] | None:
    """(Workload, Targets) from `plan`'s sizing flags, None when none is given; UsageError naming a missing one."""
    if all(getattr(args, name) is None for name in SIZING_FLAGS):
        return None
    if args.rate is None and args.users is None:
        raise UsageError("--rate: sizing needs --rate REQUESTS_PER_S or --users N")
    if args.think_seconds is not None and args.users is None:
        raise UsageError("--think-seconds: applies only with --users")
    for flag in ("prompt_tokens", "output_tokens", "ttft_p99", "itl_p99"):
        if getattr(args, flag) is None:
            raise UsageError(f"--{flag.replace('_', '-')}: required to size a fleet (with --rate or --users)")
    workload = sizing.Workload(prompt_tokens=args.prompt_tokens, output_tokens=args.output_tokens, rate=args.rate,
                               users=args.users, think_seconds=args.think_seconds or 0.0)
    targets = sizing.Targets(ttft_p99=args.ttft_p99, itl_p99=args.itl_p99)
    try:
        workload.check()
        targets.check()
    except sizing.SizingError as exc:
        raise UsageError(str(exc)) from None
    return workload, targets


def _sizing_for(args: argparse.Namespace, isvc: InferenceService, plan: Plan, facts: ModelFacts | None,
                wanted: tuple[sizing.Workload, sizing.Targets]) -> sizing.Sizing:
    """The sizing of ISVC for the workload: colocated on the decode pool's GPUs (and the prefill pool's, when
    they differ), disaggregated with spec.prefill's pool or one on --prefill-accelerator (default: the decode GPU)."""
    from tensorfleet.api.models import AcceleratorSpec, ParallelismSpec, PrefillSpec

    spec = isvc.spec
    arch = sizing.model_arch(spec, facts)
    if arch is None:
        raise UsageError(f"{isvc.name}: sizing needs the model's architecture (spec.model.architecture)")
    prefill_plan = plan.prefill
    if prefill_plan is None or args.prefill_accelerator is not None:
        base = spec.prefill or PrefillSpec(parallelism=ParallelismSpec(tensor=spec.parallelism.tensor or plan.tensor))
        accelerator = (AcceleratorSpec(type=args.prefill_accelerator) if args.prefill_accelerator
                       else base.accelerator or spec.accelerator)
        single = ParallelismSpec(tensor=plan.tensor, pipeline=1)
        try:
            split = make_plan(spec.model_copy(update={
                "parallelism": single, "kv_transfer": None,
                "prefill": base.model_copy(update={"accelerator": accelerator})}), facts)
        except SpecError as exc:
            field = "--prefill-accelerator" if args.prefill_accelerator else exc.field
            raise UsageError(f"{isvc.name}: {field}: {exc.message}") from None
        prefill_plan = split.prefill
    assert prefill_plan is not None
    decode = sizing.engine_for(plan, arch)
    prefill = sizing.engine_for(prefill_plan, arch)
    colocated = (decode,) if prefill.accelerator == decode.accelerator else (decode, prefill)
    try:
        return sizing.size(wanted[0], wanted[1], decode, prefill, colocated,
                           link_gbps=sizing.DEFAULT_LINK_GBPS if args.kv_transfer_gbps is None
                           else args.kv_transfer_gbps)
    except sizing.SizingError as exc:
        raise UsageError(str(exc)) from None


def sizing_table(result: sizing.Sizing) -> str:
    """The `sizing` block of `plan`'s table output."""
    t = result.targets
    lines = ["  sizing",
             f"    workload       {result.workload.describe()}",
             (f"    targets        TTFT p99 {t.ttft_p99:g} s, ITL p99 {t.itl_p99 * 1e3:g} ms "
              f"(KV link {result.link_gbps:g} Gbit/s per GPU)")]
    for layout in (*result.colocated, result.disaggregated):
        lines.append(f"    {layout.kind:<14} {layout.describe()}")
        if not layout.feasible:
            continue
        lines.append(f"    {'':<14} at {layout.rate:,.1f} requests/s: TTFT p99 {layout.ttft_p99:.2f} s, "
                     f"ITL p99 {layout.itl_p99 * 1e3:.0f} ms")
        for pool in layout.pools:
            batch = (f"decode batch {pool.decode_batch} (p99 {pool.decode_batch_p99}, bound by {pool.limit}), "
                     if pool.role != "prefill" else "")
            lines.append(f"    {'':<14} {pool.role}: {batch}--max-num-batched-tokens {pool.batched_tokens}, "
                         f"step {pool.step_seconds * 1e3:.0f} ms")
    lines.append(f"    choice         {result.choice}: {result.why}")
    return "\n".join(lines)


def _cmd_plan(args: argparse.Namespace) -> int:
    wanted = _workload(args)
    facts_for = _model_facts(args)
    seen: dict[int, ModelFacts | None] = {}

    def recording(isvc: InferenceService) -> tuple[ModelFacts | None, str | None]:
        facts, note = facts_for(isvc)
        seen[id(isvc)] = facts
        return facts, note

    loaded = _load(args.file, recording)
    sized = [None if wanted is None else _sizing_for(args, isvc, plan, seen.get(id(isvc)), wanted)
             for _, isvc, plan in loaded]
    if args.output == "json":
        for (_, isvc, plan), result in zip(loaded, sized, strict=True):
            summary = plan_summary(isvc, plan)
            if result is not None:
                summary["sizing"] = result.to_json()
            print(json.dumps(summary, indent=2))
    else:
        print("\n\n".join(plan_table(isvc, plan) + ("" if result is None else "\n" + sizing_table(result))
                           for (_, isvc, plan), result in zip(loaded, sized, strict=True)))
    return 0


STANDALONE_REMOVED = (
    "--standalone was removed: render writes ownerReferences only for input that has metadata.uid (a copy taken "
    "from the cluster), so a file you wrote renders without them already; delete the uid for the same with such a "
    "copy. The objects still need the operator: it rolls the engine StatefulSets out (OnDelete), scales them for "
    "the HPA and restarts broken groups"
)


def _cmd_render(args: argparse.Namespace) -> int:
    from tensorfleet.render import render

    if args.standalone:
        raise UsageError(STANDALONE_REMOVED)
    objects: list[dict[str, Any]] = []
    for _, isvc, plan in _load(args.file):
        objects += render(isvc, plan, namespace=args.namespace, gpu_device_class=args.gpu_device_class)
    sys.stdout.write(yaml.safe_dump_all(objects, sort_keys=False, explicit_start=True))
    return 0


def _cmd_crd(_: argparse.Namespace) -> int:
    sys.stdout.write(yaml.safe_dump(crd(), sort_keys=False, width=120))
    return 0


def _cmd_catalog(args: argparse.Namespace) -> int:
    gpus: list[dict[str, Any]] = [
        {"type": g.name, "memoryMiB": g.memory_mib, "bandwidthGBps": g.bandwidth_gbps, "gpusPerNode": g.gpus_per_node,
         "bf16": g.bf16, "fp8": g.fp8, "productLabels": list(g.product_labels)}
        for g in GPUS
    ]
    models: list[dict[str, Any]] = [
        {"key": m.key, "example": m.display, "parameters": m.arch.parameters, "layers": m.arch.layers,
         "attentionHeads": m.arch.attention_heads, "kvHeads": m.arch.kv_heads, "weightFormat": m.arch.weight_format,
         "moe": m.arch.moe is not None, "mla": m.arch.mla is not None, "maxContextLength": m.arch.max_context_length}
        for m in MODELS
    ]
    cpu = {"type": contract.CPU_ACCELERATOR, "memoryFrom": CPU_MEMORY_FIELD, "tensor": 1, "pipeline": 1}
    if args.output == "json":
        print(json.dumps({"gpus": gpus, "cpu": cpu, "models": models}, indent=2))
        return 0
    print("Accelerator types (spec.accelerator.type):")
    for g in gpus:
        print(f"  {g['type']:<14} {g['memoryMiB']:>7} MiB  {g['bandwidthGBps']:>5} GB/s  labels: {', '.join(g['productLabels'])}")
    print(f"  {cpu['type']:<14} vLLM's CPU backend, tensor and pipeline 1; memory from {CPU_MEMORY_FIELD}")
    print("\nModels (matched by the last part of spec.model.name):")
    for m in models:
        extra = " MoE" if m["moe"] else ""
        extra += " MLA" if m["mla"] else ""
        print(f"  {m['key']:<18} {m['parameters'] / 1e9:>7.1f}B  {m['weightFormat']:<6} e.g. {m['example']}{extra}")
    return 0


def _cmd_version(_: argparse.Namespace) -> int:
    print(contract.__version__)
    return 0


# Modules adding long-running commands (operator, router, simulator). Each
# exposes `register(subparsers)` and imports its heavy dependencies only when
# its command runs, after `extras.require` has checked that its extra is
# installed, so `plan` and `render` stay fast and need only the base install.
COMMAND_MODULES: tuple[str, ...] = ("tensorfleet.controller.cli", "tensorfleet.sim.cli", "tensorfleet.router.cli",
                                     "tensorfleet.gateway.cli")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="tensorfleet", description="Serve LLMs on Kubernetes GPU clusters.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    plan = commands.add_parser("plan", help="check that an InferenceService fits and show its capacity")
    plan.add_argument("-f", "--file", required=True, help="InferenceService YAML file, or - for stdin")
    plan.add_argument("-o", "--output", choices=("table", "json"), default="table")
    plan.add_argument("--model-config", metavar="FILE",
                      help="the model's config.json (or a directory holding it) to size it from, instead of "
                           "reading it from the Hugging Face Hub")
    plan.add_argument("--offline", action="store_true",
                      help="do not ask the Hugging Face Hub for config.json (like HF_HUB_OFFLINE=1): use the local "
                           "Hugging Face cache, else the built-in catalog")
    workload = plan.add_argument_group("sizing for a workload (docs/disaggregation.md)")
    load = workload.add_mutually_exclusive_group()
    load.add_argument("--rate", type=float, metavar="RPS", help="requests per second (Poisson arrivals)")
    load.add_argument("--users", type=int, metavar="N",
                      help="concurrent users, each sending a request, waiting for the answer, then thinking")
    workload.add_argument("--think-seconds", type=float, metavar="S", help="a user's think time (default 0)")
    workload.add_argument("--prompt-tokens", type=int, metavar="N", help="mean prompt tokens")
    workload.add_argument("--output-tokens", type=int, metavar="N", help="mean output tokens")
    workload.add_argument("--ttft-p99", type=float, metavar="S", help="time-to-first-token target, p99, seconds")
    workload.add_argument("--itl-p99", type=float, metavar="S", help="inter-token latency target, p99, seconds")
    workload.add_argument("--prefill-accelerator", metavar="TYPE",
                        help="GPU type of the prefill pool to size (default: spec.prefill's, else spec.accelerator)")
    workload.add_argument("--kv-transfer-gbps", type=float, metavar="GBPS",
                        help="KV link per GPU between the pools, Gbit/s (default 100, as the simulator)")
    plan.set_defaults(func=_cmd_plan)

    render = commands.add_parser("render", help="print the Kubernetes objects an InferenceService becomes")
    render.add_argument("-f", "--file", required=True, help="InferenceService YAML file, or - for stdin")
    render.add_argument("-n", "--namespace", help="namespace of the objects (default: metadata.namespace, else default)")
    # Removed; kept so that a script passing it gets the reason, not argparse's "unrecognized arguments".
    render.add_argument("--gpu-device-class", default=contract.DEFAULT_GPU_DEVICE_CLASS, metavar="NAME",
                        help="the DeviceClass GPU claims name under spec.accelerator.allocation deviceClass, as the "
                             f"operator's --gpu-device-class (default {contract.DEFAULT_GPU_DEVICE_CLASS})")
    render.add_argument("--standalone", action="store_true", help=argparse.SUPPRESS)
    render.set_defaults(func=_cmd_render)

    crd_cmd = commands.add_parser("crd", help="print the InferenceService CustomResourceDefinition")
    crd_cmd.set_defaults(func=_cmd_crd)

    catalog = commands.add_parser("catalog", help="list the GPU types and models the planner knows")
    catalog.add_argument("-o", "--output", choices=("table", "json"), default="table")
    catalog.set_defaults(func=_cmd_catalog)

    version = commands.add_parser("version", help="print the version")
    version.set_defaults(func=_cmd_version)

    for module in COMMAND_MODULES:
        importlib.import_module(module).register(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except UsageError as exc:
        sys.stderr.write(f"error: {one_line(str(exc))}\n")
        return EXIT_INVALID
    except MissingExtra as exc:
        sys.stderr.write(f"error: {exc}\n")
        return EXIT_MISSING_EXTRA
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
