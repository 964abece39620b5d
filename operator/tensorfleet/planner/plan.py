"""Does a model fit on these GPUs, and how many requests can it hold? `plan_pool(spec, facts)` (through
`entry.make_plan`) resolves the model's and the GPU's facts, checks the parallel layout against vLLM's rules, picks
the smallest layout that fits when the spec leaves one open, sizes memory (`memory.py`, LoRA slots from `lora.py`),
and returns a Plan or raises SpecError naming the field and what would fit. Design:
docs/planner.md#choosing-the-layout."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from tensorfleet import contract, vllm_defaults
from tensorfleet.api.architecture import ArchitectureSpec
from tensorfleet.api.base import quantity_bytes
from tensorfleet.api.errors import SpecError
from tensorfleet.api.models import LORA_RANKS, InferenceServiceSpec
from tensorfleet.api.status import PlanStatus
from tensorfleet.catalog import CPU, GPUType, ModelFacts, accelerator_names, catalog_facts, find_gpu, is_cpu, sizes
from tensorfleet.catalog.facts import from_architecture
from tensorfleet.catalog.formats import BITS, UNQUANTIZED, family
from tensorfleet.engine_settings import engine_arg_value
from tensorfleet.planner import hybrid, kvcache, memory
from tensorfleet.planner import lora as lora_memory
from tensorfleet.planner.lora import LoraPlan, LoraSettings
from tensorfleet.planner.memory import GiB

MAX_PIPELINE = 64
CPU_MEMORY_FIELD = "spec.engine.resources.requests.memory"
# Plan.load_seconds: vLLM's own start (CUDA init, profiling, graph capture) is one to two minutes on an
# H100; weights stream from the model cache volume at a conservative 500 MB/s per GPU.
ENGINE_START_SECONDS = 120
WEIGHT_LOAD_BYTES_PER_SECOND = 500_000_000


@dataclass(frozen=True)
class Resolved:
    """Everything a layout is sized with, fixed before trying layouts."""

    model: str
    arch: ArchitectureSpec
    facts: ModelFacts
    bits: float | None          # set when the engine re-quantizes every linear weight at load time (fp8)
    gpu: GPUType
    gpus_per_node: int
    weight_format: str
    dtype: str
    engine_dtype: str
    kv_element_bytes: int
    max_model_len: int
    utilization: float
    max_num_seqs: int
    batched_tokens: int
    lora: LoraSettings | None = None   # None: LoRA off
    cpu: bool = False                  # vLLM's CPU backend: `gpu` stands for the container's memory request
    hybrid_kv: bool = True             # vLLM's hybrid KV-cache manager runs (planner/kvcache.py)
    engine_args: tuple[str, ...] = ()  # spec.engine.args, for the flags that change what vLLM allocates
    state_cache: kvcache.StateCacheMode = "none"   # how vLLM keeps a hybrid model's state pages (planner/hybrid.py)


@dataclass(frozen=True)
class Plan:
    model: str
    accelerator: str
    tensor: int
    pipeline: int
    max_model_len: int
    dtype: str          # what the engine computes in (for sizing and display): the spec's, or auto resolved
    engine_dtype: str   # what `--dtype` says: the spec's, `auto` included (see _engine_dtype)
    weight_format: str
    kv_cache_dtype: str
    gpu_memory_bytes: int
    budget_bytes_per_gpu: int
    weight_bytes_total: int
    weight_bytes_per_gpu: int
    activation_bytes_per_gpu: int
    non_torch_bytes_per_gpu: int
    kv_bytes_per_gpu: int
    kv_bytes_per_token_per_gpu: int
    kv_cache_tokens: int
    kv_pool: kvcache.KVPool   # the blocks and groups behind kv_cache_tokens and the concurrency figures
    max_num_seqs: int
    # vLLM's --max-num-batched-tokens as it defaults on this GPU: one step's token budget, the most prompt an
    # engine computes at once (the router bounds each engine's queued prompts by it: router/dispatch.py).
    batched_tokens: int
    auto_layout: bool
    notes: tuple[str, ...] = field(default=())
    model_source: str = "catalog"       # where the model's facts came from (catalog/facts.py MODEL_SOURCES)
    model_revision: str | None = None   # the commit its config.json was read at, when known
    weight_detail: str = ""             # the weight format in words (method, group size, layers left 16-bit)
    lora: LoraPlan | None = None        # LoRA as the engines start with it; None: off (spec.lora_enabled)
    prefill: Plan | None = None         # with spec.prefill: the prefill pool's plan (planner/disagg.py)
    kv_connector: str | None = None     # with spec.prefill: the KV connector both pools run (set on both plans)
    # A hybrid model's: one state layer's state for one request on one GPU, and the page vLLM pads it to (every
    # layer's block: kv_pool.block_size tokens of one attention layer); 0 for other models.
    state_bytes_per_gpu: int = 0
    state_page_bytes: int = 0

    @property
    def lora_bytes_per_gpu(self) -> int:
        """GPU memory the LoRA slots and their working buffers take from the KV cache, per GPU (0 without LoRA)."""
        return self.lora.bytes_per_gpu if self.lora is not None else 0

    @property
    def gpus_per_replica(self) -> int:
        """tensor x pipeline; none on CPU."""
        return 0 if self.cpu else self.tensor * self.pipeline

    @property
    def cpu(self) -> bool:
        """vLLM's CPU backend: gpu_memory_bytes is the engine container's memory request, no GPU is used."""
        return self.accelerator == CPU

    @property
    def cpu_kv_cache_gib(self) -> int:
        """On CPU, the KV cache vLLM allocates, in whole GiB (its VLLM_CPU_KVCACHE_SPACE)."""
        return self.kv_bytes_per_gpu // GiB

    @property
    def max_concurrency(self) -> float:
        """vLLM's "Maximum concurrency for N tokens per request" figure (planner/kvcache.py)."""
        return self.kv_pool.concurrency(self.max_model_len)

    @property
    def max_concurrent_sequences(self) -> int:
        return math.floor(self.max_concurrency)

    @property
    def fits(self) -> bool:
        """vLLM starts only when one request of max_model_len tokens fits the pool."""
        return self.kv_pool.num_blocks > 0 and self.max_concurrency >= 1

    @property
    def longest_request(self) -> int:
        """The longest max_model_len this pool holds one request of (vLLM's estimate when it refuses to start)."""
        return self.kv_pool.longest_request(max(self.max_model_len, self.kv_cache_tokens))

    def engine_concurrency(self, typical_request_tokens: int) -> int:
        """Requests one replica's engine holds at once without running out of KV cache: vLLM's maximum
        concurrency at a typical request's length (prompt + output, capped at max_model_len), within
        [1, max_num_seqs]. Beyond it vLLM only queues or preempts, so the router keeps the rest (and the
        autoscaler sees them)."""
        typical = max(1, min(typical_request_tokens, self.max_model_len))
        return max(1, min(self.max_num_seqs, math.floor(self.kv_pool.concurrency(typical))))

    @property
    def load_seconds(self) -> int:
        """A generous estimate of a replica's start: the engine's own (CUDA, graph capture) plus reading each
        GPU's weights from the model cache. Sizes the router's default cold-start timeout."""
        return ENGINE_START_SECONDS + math.ceil(self.weight_bytes_per_gpu / WEIGHT_LOAD_BYTES_PER_SECOND)

    def to_status(self) -> PlanStatus:
        return PlanStatus(
            accelerator=self.accelerator,
            tensor=self.tensor,
            pipeline=self.pipeline,
            gpus_per_replica=self.gpus_per_replica,
            max_model_len=self.max_model_len,
            weights_per_gpu=gib(self.weight_bytes_per_gpu),
            kv_cache_bytes_per_token=self.kv_bytes_per_token_per_gpu,
            kv_cache_tokens=self.kv_cache_tokens,
            max_concurrent_sequences=self.max_concurrent_sequences,
            load_seconds=self.load_seconds,
            model_source=self.model_source,
            **({} if self.lora is None else {
                "max_loras": self.lora.max_loras,
                "max_lora_rank": self.lora.max_rank,
                "max_cpu_loras": self.lora.max_cpu_loras,
                "lora_memory_per_gpu": gib(self.lora.bytes_per_gpu),
            }),
        )


def gib(value: float) -> str:
    return f"{value / GiB:.1f}Gi"


# --- resolving facts -------------------------------------------------------------


def _hybrid_kv(spec: InferenceServiceSpec, kv_connector: bool) -> bool:
    """Whether vLLM runs its hybrid KV-cache manager (vllm/config/vllm.py): on GPUs and on its CPU backend alike
    (its CPU platform supports it, 0.19 and 0.32), not beside a KV connector (spec.prefill), not when engine.args
    turn it off; engine.args can insist on it only where nothing turns it off. KV events turn it off too, so the
    operator has only engines whose layers all keep full attention publish them (render.meta.publishes_kv_events),
    where the manager changes nothing, and spec.engine.args may not pass them."""
    args = spec.engine.args
    if engine_arg_value(args, "--disable-hybrid-kv-cache-manager") is not None:
        return False
    return engine_arg_value(args, "--no-disable-hybrid-kv-cache-manager") is not None or not kv_connector


def _state_cache(spec: InferenceServiceSpec, arch: ArchitectureSpec) -> kvcache.StateCacheMode:
    """How vLLM keeps a hybrid model's state pages: prefix caching is off for hybrid models unless engine.args
    turn it on (--enable-prefix-caching), and --mamba-cache-mode may choose how."""
    if arch.mamba is None:
        return "none"
    args = spec.engine.args
    on = (engine_arg_value(args, "--enable-prefix-caching") is not None
          and engine_arg_value(args, "--no-enable-prefix-caching") is None)
    return hybrid.cache_mode(arch.mamba, on, engine_arg_value(args, "--mamba-cache-mode"))


def _check_state_layers(spec: InferenceServiceSpec, arch: ArchitectureSpec, cpu: bool, hybrid_kv: bool,
                        kv_connector: bool) -> None:
    """What vLLM 0.19 refuses for a hybrid model (state layers beside attention ones), each refusal naming its
    field: its CPU backend has no kernels for the state layers, and without the hybrid KV-cache manager it cannot
    put them in one group with attention layers ("failed to convert the KV cache specs to one unified type")."""
    if arch.mamba is None:
        return
    what = f"{spec.model.name} has {arch.mamba.layers} {arch.mamba.kind} state layers beside attention ones"
    if cpu:
        raise SpecError("spec.accelerator.type", f"{CPU}: {what}, and vLLM's CPU backend runs none (their kernels are "
                                                 "Triton GPU kernels); choose a GPU type")
    if hybrid_kv:
        return
    args = spec.engine.args
    refused = "vLLM starts it only with its hybrid KV-cache manager"
    if engine_arg_value(args, "--disable-hybrid-kv-cache-manager") is not None:
        raise SpecError("spec.engine.args", f"--disable-hybrid-kv-cache-manager: {what}; {refused}: remove the flag")
    if kv_connector:
        raise SpecError("spec.prefill", f"the KV connector turns vLLM's hybrid KV-cache manager off (as vLLM does "
                                        f"beside --kv-transfer-config): {what}; {refused}: add "
                                        "--no-disable-hybrid-kv-cache-manager to spec.engine.args (NixlConnector "
                                        "supports it), or remove spec.prefill")


def _batched_tokens(spec: InferenceServiceSpec, default: int) -> int:
    """vLLM's --max-num-batched-tokens: engine.args' where they set one, else its default on this device."""
    value = engine_arg_value(spec.engine.args, "--max-num-batched-tokens")
    return int(value) if value is not None and value.strip().isdigit() and int(value) > 0 else default


def _resolve(spec: InferenceServiceSpec, given: ModelFacts | None, kv_connector: bool = False) -> Resolved:
    cpu = is_cpu(spec.accelerator.type)
    gpu = _cpu_device(spec) if cpu else find_gpu(spec.accelerator.type)
    if gpu is None:
        raise SpecError(
            "spec.accelerator.type",
            f"unknown GPU type {spec.accelerator.type!r}; known types: {', '.join(accelerator_names())}",
        )
    facts = _model_facts(spec, given)
    arch = facts.arch
    _check_state_layers(spec, arch, cpu, _hybrid_kv(spec, kv_connector), kv_connector)
    native = facts.weight_format.name
    weight_format = _weight_format(spec, native, facts.source, gpu)
    # fp8 may be quantized at load time; awq/gptq name the checkpoint itself; a float16 config says so.
    checkpoint = "fp16" if facts.dtype == "float16" else family(native if weight_format == "fp8" else weight_format)
    dtype = _dtype(spec, gpu, checkpoint)
    kv_element_bytes = sizes.kv_element_bytes(spec.engine.kv_cache_dtype)
    max_model_len = _max_model_len(spec, arch)
    batch = (vllm_defaults.cpu_batch_defaults(spec.parallelism.tensor or 1) if cpu
             else vllm_defaults.batch_defaults(gpu_memory_mib=gpu.memory_mib, gpu_name=gpu.name))
    return Resolved(
        model=spec.model.name,
        arch=arch,
        facts=facts,
        bits=BITS[weight_format] if weight_format != native else None,
        gpu=gpu,
        gpus_per_node=spec.accelerator.gpus_per_node or gpu.gpus_per_node,
        weight_format=weight_format,
        dtype=dtype,
        engine_dtype=_engine_dtype(spec, gpu),
        kv_element_bytes=kv_element_bytes,
        max_model_len=max_model_len,
        utilization=1.0 if cpu else spec.engine.gpu_memory_utilization,
        max_num_seqs=spec.engine.max_num_seqs or batch.max_num_seqs,
        batched_tokens=_batched_tokens(spec, batch.max_num_batched_tokens),
        lora=lora_memory.settings(spec),
        cpu=cpu,
        hybrid_kv=_hybrid_kv(spec, kv_connector),
        engine_args=tuple(spec.engine.args),
        state_cache=_state_cache(spec, arch),
    )


def _check_cpu(spec: InferenceServiceSpec) -> None:
    """What vLLM's CPU backend takes (vllm/platforms/cpu.py), each refusal naming its field."""
    where = f"with spec.accelerator.type {CPU} (vLLM's CPU backend)"
    if spec.engine.kind != "vllm":
        raise SpecError("spec.accelerator.type", f"{CPU} runs vLLM's CPU backend, for spec.engine.kind vllm; the "
                                                 f"{spec.engine.kind} models a GPU type's timing: name one (it needs no GPU)")
    if spec.parallelism.pipeline not in (None, 1):
        raise SpecError("spec.parallelism.pipeline", f"{spec.parallelism.pipeline}: {where} a replica is one pod (the CPU "
                                                     "backend runs its workers as local processes instead of over Ray, so "
                                                     "it cannot span pods); set pipeline 1 and a larger memory request")
    if spec.accelerator.gpus_per_node is not None:
        raise SpecError("spec.accelerator.gpusPerNode", f"applies to GPU types; remove it {where}")
    if spec.accelerator.allocation != contract.ALLOCATION_EXTENDED_RESOURCE:
        raise SpecError("spec.accelerator.allocation", f"{spec.accelerator.allocation} allocates GPUs; {where} a pod "
                                                       "asks for none: remove it")
    if spec.engine.kv_cache_dtype != "auto":
        raise SpecError("spec.engine.kvCacheDtype", f"{spec.engine.kv_cache_dtype}: vLLM's CPU backend refuses a quantized "
                                                    "KV cache beside chunked prefill and prefix caching (its defaults); "
                                                    "use auto")
    if "gpu_memory_utilization" in spec.engine.model_fields_set:
        raise SpecError("spec.engine.gpuMemoryUtilization", f"does not apply {where}: it takes a KV cache of the size "
                                                            f"the planner fits in {CPU_MEMORY_FIELD}; remove it")


def _cpu_device(spec: InferenceServiceSpec) -> GPUType:
    """The engine container's memory request, standing for a GPU's memory in the sizing (the CPU backend's "device")."""
    _check_cpu(spec)
    resources = spec.engine.resources
    memory = resources.requests.get("memory") if resources is not None else None
    if memory is None:
        raise SpecError(CPU_MEMORY_FIELD, f"required with spec.accelerator.type {CPU}: the planner fits the weights, the "
                                          "KV cache and vLLM's processes in it, e.g. 24Gi")
    return GPUType(CPU, quantity_bytes(memory) // (1024 * 1024), 0, (), gpus_per_node=1)


def _model_facts(spec: InferenceServiceSpec, given: ModelFacts | None) -> ModelFacts:
    """spec.model.architecture, else the facts read from config.json, else the catalog's."""
    arch = spec.model.architecture
    if arch is not None:
        return from_architecture(spec.model.name, arch, arch.weight_format, "spec")
    if given is not None:
        return given
    found = catalog_facts(spec.model.name)
    if found is None:
        raise SpecError(
            "spec.model.architecture",
            f"model {spec.model.name!r} is not in the catalog and no config.json was read for it; add "
            "spec.model.architecture with its facts from config.json (parameters, layers, hiddenSize, attentionHeads, "
            "kvHeads), give `tensorfleet plan --model-config config.json`, or run `tensorfleet catalog`",
        )
    return found


def _weight_format(spec: InferenceServiceSpec, native: str, source: str, gpu: GPUType) -> str:
    wanted = spec.model.quantization
    name = spec.model.name
    if wanted is None:
        return native
    if wanted == "none":
        if native not in UNQUANTIZED:
            raise SpecError(
                "spec.model.quantization",
                f"'none' is impossible: {name} ships {native} weights; omit the field to serve them as they are",
            )
        return native
    if wanted == "fp8":
        if native in {"bf16", "fp16", "fp8"}:
            return "fp8"
        raise SpecError(
            "spec.model.quantization",
            f"fp8 cannot re-quantize {name}, which ships {native} weights; omit the field",
        )
    # awq / gptq: a property of the checkpoint; vLLM cannot produce it at load time.
    if family(native) == wanted:
        return native
    if source == "spec":
        return wanted
    raise SpecError(
        "spec.model.quantization",
        f"{wanted} needs a checkpoint quantized with {wanted.upper()}, but {name} ships {native} weights; "
        f"point spec.model.name at a {wanted.upper()} checkpoint, or use quantization fp8",
    )


# Checkpoints whose config.json names float16 (AWQ and GPTQ kernels compute in it).
_FLOAT16_CHECKPOINTS = {"fp16", "awq", "gptq"}


def _dtype(spec: InferenceServiceSpec, gpu: GPUType, checkpoint: str) -> str:
    """The dtype the engine computes in: the spec's, or for auto the checkpoint's as vLLM picks it."""
    if spec.model.dtype == "bfloat16" and not gpu.bf16:
        raise SpecError("spec.model.dtype", f"{gpu.name} has no bfloat16 support; use float16 or auto")
    if spec.model.dtype == "auto":
        return "float16" if checkpoint in _FLOAT16_CHECKPOINTS or not gpu.bf16 else "bfloat16"
    return spec.model.dtype


def _engine_dtype(spec: InferenceServiceSpec, gpu: GPUType) -> str:
    """The `--dtype` vLLM gets: what the spec says, `auto` included, so vLLM follows the checkpoint.

    The one exception: on a GPU without bfloat16 (T4, V100), auto would pick bfloat16
    for a bfloat16 checkpoint and fail to start, so the flag says float16, which is
    also what auto picks for a float16 checkpoint.
    """
    if spec.model.dtype == "auto" and not gpu.bf16:
        return "float16"
    return spec.model.dtype


def _max_model_len(spec: InferenceServiceSpec, arch: ArchitectureSpec) -> int:
    wanted = spec.model.max_model_len
    limit = arch.max_context_length
    if wanted is None:
        if limit is None:
            raise SpecError(
                "spec.model.maxModelLen",
                "required: the model's context length is unknown (set it, or architecture.maxContextLength)",
            )
        return limit
    if limit is not None and wanted > limit:
        raise SpecError(
            "spec.model.maxModelLen",
            f"{wanted} exceeds the model's context length {limit}; use at most {limit}",
        )
    return wanted


# --- layout rules ----------------------------------------------------------------


def _tensor_problem(arch: ArchitectureSpec, tensor: int) -> str | None:
    heads = arch.attention_heads
    kv_heads = arch.kv_heads or heads
    if heads % tensor:
        return f"{tensor} does not divide the model's {heads} attention heads"
    if arch.mla is None and kv_heads % tensor and tensor % kv_heads:
        return f"{tensor} and the model's {kv_heads} KV heads must divide one another"
    if arch.mamba is not None:
        return hybrid.tensor_problem(arch.mamba, tensor)
    return None


def valid_tensor_sizes(arch: ArchitectureSpec, gpus_per_node: int) -> list[int]:
    return [t for t in range(1, gpus_per_node + 1) if _tensor_problem(arch, t) is None]


def _kv_bytes(free: int, cpu: bool) -> int:
    """The KV cache FREE bytes give: all of them on a GPU; on CPU whole GiB (VLLM_CPU_KVCACHE_SPACE)."""
    free = max(free, 0)
    return free // GiB * GiB if cpu else free


def _kv_pool(r: Resolved, stages: list[memory.Stage], reserve: int, state: hybrid.HybridBlock | None
             ) -> tuple[kvcache.KVPool, memory.Stage]:
    """The engine's KV pool with RESERVE bytes per GPU beside each stage's weights, and the stage that sized it
    (the fewest blocks: planner/kvcache.py). STATE: a hybrid model's block (_hybrid_block)."""
    block, logged_block = _base_block(r), None
    if state is not None:
        block = state.block_size
        # One state per request: the state group's block is max_model_len, and vLLM logs the pool in the smaller.
        logged_block = min(block, r.max_model_len) if r.state_cache == "none" else block
    grouping = kvcache.group_layers(kvcache.model_layers(r.arch, r.state_cache), r.hybrid_kv)
    found, worst = kvcache.pool(
        grouping, [(stage.layer_indices, _kv_bytes(reserve - stage.weight_bytes_per_gpu, r.cpu)) for stage in stages],
        block * stages[0].kv_bytes_per_token_layer, block, max(r.batched_tokens, r.max_num_seqs), logged_block)
    return found, stages[worst]


def _base_block(r: Resolved) -> int:
    return vllm_defaults.CPU_BLOCK_SIZE if r.cpu else vllm_defaults.BLOCK_SIZE


def _hybrid_block(r: Resolved, tensor: int, token_bytes: int) -> hybrid.HybridBlock | None:
    """The attention block vLLM chooses for a hybrid model at TENSOR ranks (planner/hybrid.py); None for others."""
    if r.arch.mamba is None:
        return None
    model_bytes = 4 if r.dtype == "float32" else 2
    conv, ssm = hybrid.state_element_bytes(r.arch.mamba, model_bytes, engine_arg_value(r.engine_args, "--mamba-cache-dtype"),
                                           engine_arg_value(r.engine_args, "--mamba-ssm-cache-dtype"))
    state = hybrid.state_bytes(r.arch.mamba, tensor, conv, ssm)
    return hybrid.block_size(state, token_bytes, _base_block(r), r.state_cache, r.arch.mamba.chunk_size)


def size_layout(r: Resolved, tensor: int, pipeline: int, auto: bool = False, max_loras: int | None = None) -> Plan:
    """Size one layout (assumed valid). `plan.fits` says whether it serves. MAX_LORAS overrides the LoRA slots."""
    arch = r.arch
    stages = memory.facts_stages(r.facts, tensor, pipeline, r.kv_element_bytes, r.bits)
    notes: list[str] = list(r.facts.notes)
    if r.cpu:
        # The container's memory request, all of it, shared by the tensor ranks (each holds its shard of the
        # weights, its activations and a KV cache of VLLM_CPU_KVCACHE_SPACE); nothing is profiled; vLLM's
        # processes take their share.
        budget, non_torch = r.gpu.memory_bytes // tensor, memory.cpu_runtime_bytes(tensor) // tensor
    else:
        budget = int(memory.cuda_total_bytes(r.gpu.memory_bytes) * r.utilization)
        flag = engine_arg_value(r.engine_args, "--disable-custom-all-reduce") is not None
        all_reduce = memory.custom_all_reduce(tensor, r.gpu.nvlink, flag)
        non_torch = memory.non_torch_bytes(tensor, pipeline, all_reduce)
        if tensor > 1 and not all_reduce:
            why = ("--disable-custom-all-reduce in spec.engine.args" if flag else
                   f"{r.gpu.name} GPUs are not joined by NVLink" if not r.gpu.nvlink else
                   f"tensor {tensor} is not a size it supports")
            notes.append(f"vLLM's custom all-reduce does not run ({why}): NCCL's buffers alone, "
                         f"{gib(non_torch)} per GPU")
    activation = memory.activation_peak_bytes(arch, tensor, r.batched_tokens, r.max_num_seqs)
    state = _hybrid_block(r, tensor, stages[0].kv_bytes_per_token_layer)
    kv_pool, worst = _kv_pool(r, stages, budget - activation - non_torch, state)
    lora: LoraPlan | None = None
    if r.lora is not None:
        # The LoRA slots come out of every stage's budget, like the activation reserve.
        kv_without_lora = max(budget - worst.weight_bytes_per_gpu - activation - non_torch, 0)
        lora = lora_memory.size(r.lora, arch, tensor, pipeline, r.batched_tokens, kv_without_lora, max_loras)
        kv_pool, worst = _kv_pool(r, stages, budget - activation - non_torch - lora.bytes_per_gpu, state)
        notes += lora_memory.notes(r.lora, lora, arch)
    lora_bytes = lora.bytes_per_gpu if lora is not None else 0
    kv_heads = arch.kv_heads or arch.attention_heads
    if arch.mla is None and tensor > kv_heads:
        notes.append(f"tensor {tensor} > {kv_heads} KV heads: each KV head is replicated on {tensor // kv_heads} GPUs")
    kv_bytes = _kv_bytes(budget - worst.weight_bytes_per_gpu - activation - non_torch - lora_bytes, r.cpu)
    if r.cpu:
        per = f" per tensor-parallel worker ({tensor} share the request)" if tensor > 1 else ""
        notes.append(f"vLLM's CPU backend: a KV cache of {kv_bytes // GiB} GiB ({contract.ENV_CPU_KVCACHE_SPACE}) "
                     f"beside {gib(max(s.weight_bytes_per_gpu for s in stages))} of weights and "
                     f"{gib(activation + non_torch + lora_bytes)} for activations and vLLM's processes{per}, in the "
                     f"{gib(r.gpu.memory_bytes)} of {CPU_MEMORY_FIELD}")
    return Plan(
        model=r.model,
        accelerator=r.gpu.name,
        tensor=tensor,
        pipeline=pipeline,
        max_model_len=r.max_model_len,
        dtype=r.dtype,
        engine_dtype=r.engine_dtype,
        weight_format=r.weight_format,
        kv_cache_dtype="fp8" if r.kv_element_bytes == 1 else r.dtype,
        gpu_memory_bytes=r.gpu.memory_bytes,
        budget_bytes_per_gpu=budget,
        weight_bytes_total=r.facts.weight_bytes(r.bits),
        weight_bytes_per_gpu=max(s.weight_bytes_per_gpu for s in stages),
        activation_bytes_per_gpu=activation,
        non_torch_bytes_per_gpu=non_torch,
        kv_bytes_per_gpu=kv_bytes,
        kv_bytes_per_token_per_gpu=max(s.kv_bytes_per_token_per_gpu for s in stages),
        kv_cache_tokens=kv_pool.tokens,
        max_num_seqs=r.max_num_seqs,
        # vLLM raises the budget to max-num-seqs, so a step can hold one token of every sequence.
        batched_tokens=max(r.batched_tokens, r.max_num_seqs),
        auto_layout=auto,
        notes=tuple(notes),
        model_source=r.facts.source,
        model_revision=r.facts.revision,
        weight_detail=f"{r.weight_format}, quantized at load time" if r.bits is not None else r.facts.weight_format.detail,
        lora=lora,
        kv_pool=kv_pool,
        state_bytes_per_gpu=state.state_bytes if state else 0,
        state_page_bytes=state.page_bytes if state else 0,
    )


def _search(r: Resolved, tensor: int | None, pipeline: int | None) -> Plan | None:
    """Smallest fitting layout with the given sizes fixed (None = free)."""
    tensors = [tensor] if tensor else valid_tensor_sizes(r.arch, r.gpus_per_node)
    if not tensors:
        return None
    max_pipeline = min(r.arch.layers, MAX_PIPELINE)
    pipelines = [pipeline] if pipeline else range(1, max_pipeline + 1)
    for pp in pipelines:
        # Beyond one node, fill each node: tensor = the largest valid size.
        candidates = tensors if (pp == 1 or tensor or pipeline) else tensors[-1:]
        for tp in candidates:
            if pp > r.arch.layers:
                return None
            candidate = size_layout(r, tp, pp, auto=True)
            if candidate.fits:
                return candidate
    return None


def _describe_layout(p: Plan) -> str:
    return f"tensor {p.tensor}" + (f" x pipeline {p.pipeline}" if p.pipeline > 1 else "")


def _alternatives(r: Resolved, spec: InferenceServiceSpec, failed: Plan) -> str:
    """What would fit instead, for the error message."""
    options: list[str] = []
    smallest = _search(r, None, failed.pipeline if failed.pipeline > 1 else None)
    if smallest is None and failed.pipeline > 1:
        smallest = _search(r, None, None)
    if smallest is not None and (smallest.tensor, smallest.pipeline) != (failed.tensor, failed.pipeline):
        if smallest.pipeline == failed.pipeline:
            options.append(f"needs tensor >= {smallest.tensor} on {r.gpu.name}")
        else:
            options.append(f"needs {_describe_layout(smallest)} on {r.gpu.name}")
    if r.weight_format in {"bf16", "fp16"}:
        quantized = size_layout(replace(r, weight_format="fp8", bits=BITS["fp8"]), failed.tensor, failed.pipeline)
        if quantized.fits:
            options.append("or spec.model.quantization: fp8")
    if r.kv_element_bytes == 2 and spec.engine.kv_cache_dtype == "auto":
        kv8 = size_layout(replace(r, kv_element_bytes=1), failed.tensor, failed.pipeline)
        if kv8.fits:
            options.append("or spec.engine.kvCacheDtype: fp8")
    if failed.longest_request >= 128:
        options.append(f"or spec.model.maxModelLen <= {failed.longest_request}")
    if r.utilization < 0.95:
        tighter = size_layout(replace(r, utilization=0.95), failed.tensor, failed.pipeline)
        if tighter.fits:
            options.append("or spec.engine.gpuMemoryUtilization: 0.95")
    if not options:
        options.append("no layout of up to 64 nodes fits; choose a larger GPU type or a quantized checkpoint")
    text = ", ".join(options)
    return text.removeprefix("or ")


def _check_layout(r: Resolved, tensor: int | None, pipeline: int | None) -> None:
    if tensor is not None:
        if tensor > r.gpus_per_node:
            valid = valid_tensor_sizes(r.arch, r.gpus_per_node)
            largest = valid[-1] if valid else 1
            pp = -(-tensor // largest)
            raise SpecError(
                "spec.parallelism.tensor",
                f"{tensor} exceeds the {r.gpus_per_node} GPUs of one {r.gpu.name} node (tensor parallelism stays inside a node); "
                f"use tensor {largest} with pipeline {pp}, or set spec.accelerator.gpusPerNode if your nodes have more",
            )
        problem = _tensor_problem(r.arch, tensor)
        if problem:
            valid = valid_tensor_sizes(r.arch, r.gpus_per_node)
            raise SpecError(
                "spec.parallelism.tensor",
                f"{problem}; valid sizes on {r.gpu.name}: {', '.join(map(str, valid)) or 'none'}",
            )
    if pipeline is not None and pipeline > r.arch.layers:
        raise SpecError(
            "spec.parallelism.pipeline",
            f"{pipeline} exceeds the model's {r.arch.layers} layers; each stage needs at least one layer",
        )


def plan_pool(spec: InferenceServiceSpec, facts: ModelFacts | None = None, kv_connector: bool = False) -> Plan:
    """Plan one replica of the pool SPEC describes. Raises SpecError with the field and a layout that fits.

    FACTS are the model's, read from its config.json by the caller
    (`tensorfleet.modelinfo.resolve_model`); without them the catalog answers.
    spec.model.architecture wins over both. KV_CONNECTOR: the engines run a KV connector (a pool of spec.prefill's).
    """
    r = _resolve(spec, facts, kv_connector)
    tensor, pipeline = spec.parallelism.tensor, spec.parallelism.pipeline
    if r.cpu:
        # One pod (_check_cpu) of `tensor` worker processes, each on its own share of the pod's cores; the memory
        # request decides the rest.
        cpu_tensor = tensor or 1
        problem = _tensor_problem(r.arch, cpu_tensor)
        if problem is not None:
            raise SpecError("spec.parallelism.tensor", problem)
        chosen = size_layout(r, cpu_tensor, 1, auto=not (tensor and pipeline))
        if chosen.fits:
            return chosen
        raise _cpu_does_not_fit(r, chosen)
    _check_layout(r, tensor, pipeline)
    if tensor and pipeline:
        chosen = size_layout(r, tensor, pipeline)
        if chosen.fits:
            return chosen
        raise _does_not_fit(r, spec, chosen, "spec.parallelism")
    found = _search(r, tensor, pipeline)
    if found is not None:
        return found
    # Report against the largest layout the fixed fields allow.
    valid = valid_tensor_sizes(r.arch, r.gpus_per_node)
    failed = size_layout(r, tensor or (valid[-1] if valid else 1), pipeline or 1)
    if tensor is None and pipeline is None and not valid:
        raise SpecError("spec.parallelism.tensor", f"no tensor size up to {r.gpus_per_node} divides the model's attention heads")
    field_name = "spec.parallelism" if (tensor or pipeline) else "spec.model.name"
    raise _does_not_fit(r, spec, failed, field_name)


def _does_not_fit(r: Resolved, spec: InferenceServiceSpec, failed: Plan, field_name: str) -> SpecError:
    if r.lora is not None and size_layout(replace(r, lora=None), failed.tensor, failed.pipeline).fits:
        return _lora_does_not_fit(r, failed)
    weights_free = failed.budget_bytes_per_gpu - failed.weight_bytes_per_gpu - failed.activation_bytes_per_gpu - failed.non_torch_bytes_per_gpu
    layout = _describe_layout(failed)
    if weights_free <= 0:
        lora = f" (LoRA slots {gib(failed.lora_bytes_per_gpu)} of it)" if failed.lora is not None else ""
        why = (
            f"{r.model} ({r.weight_format}) needs {gib(failed.weight_bytes_per_gpu)} of weights per GPU at {layout} plus "
            f"{gib(failed.activation_bytes_per_gpu + failed.non_torch_bytes_per_gpu + failed.lora_bytes_per_gpu)} "
            f"reserve{lora}, more than the "
            f"{gib(failed.budget_bytes_per_gpu)} one {r.gpu.name} gives at gpuMemoryUtilization {r.utilization}"
        )
    else:
        lora = f" beside {gib(failed.lora_bytes_per_gpu)} of LoRA slots" if failed.lora is not None else ""
        why = (
            f"at {layout} on {r.gpu.name} the KV cache holds {failed.kv_cache_tokens} tokens{lora}, "
            f"fewer than one sequence of maxModelLen {r.max_model_len}"
        )
    return SpecError(field_name, f"{why}; {_alternatives(r, spec, failed)}")


def _lora_does_not_fit(r: Resolved, failed: Plan) -> SpecError:
    """The layout would serve without LoRA: say what the LoRA slots cost and how many would fit."""
    assert r.lora is not None and failed.lora is not None
    lora = failed.lora
    layout = _describe_layout(failed)
    fitting = next((n for n in range(lora.max_loras - 1, 0, -1)
                    if size_layout(r, failed.tensor, failed.pipeline, max_loras=n).fits), 0)
    why = (
        f"{lora.max_loras} LoRA slot{'s' if lora.max_loras > 1 else ''} at rank {lora.max_rank} take "
        f"{gib(failed.lora_bytes_per_gpu)} per GPU at {layout} on {r.gpu.name}, leaving the KV cache "
        f"{failed.kv_cache_tokens} tokens, fewer than one sequence of maxModelLen {r.max_model_len}"
    )
    fixes: list[str] = []
    if r.lora.max_loras is not None:
        field_name = "spec.engine.lora.maxLoras"
        if fitting:
            fixes.append(f"set maxLoras <= {fitting} (that many slots fit there)")
        else:
            why += "; not one slot fits there"
    else:
        field_name = "spec.engine.lora.maxRank"
    if lora.max_rank > LORA_RANKS[0]:
        fixes.append("lower spec.engine.lora.maxRank (no adapter's rank may exceed it)")
    if failed.longest_request >= 128:
        fixes.append(f"set spec.model.maxModelLen <= {failed.longest_request}")
    larger = _search(r, None, None)
    if larger is not None and (larger.tensor, larger.pipeline) != (failed.tensor, failed.pipeline):
        fixes.append(f"use {_describe_layout(larger)} on {r.gpu.name}")
    if not fixes:
        fixes.append("choose a larger GPU type")
    return SpecError(field_name, f"{why}; {', or '.join(fixes)}")


def _cpu_request_that_fits(r: Resolved, failed: Plan) -> int | None:
    """The smallest memory request, in whole GiB, that serves one sequence of maxModelLen on CPU (None: none
    up to 4 TiB, the model's context alone being too large)."""
    def fits(gib_: int) -> bool:
        return size_layout(replace(r, gpu=replace(r.gpu, memory_mib=gib_ * 1024)), failed.tensor, 1).fits

    high = 1
    while not fits(high):
        high *= 2
        if high > 4096:
            return None
    low = high // 2   # does not fit (or 0)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if fits(middle) else (middle, high)
    return high


def _cpu_does_not_fit(r: Resolved, failed: Plan) -> SpecError:
    """The request is too small: say what takes it, and the request (or context) that would fit."""
    ranks = failed.tensor
    request = gib(r.gpu.memory_bytes)
    reserve = failed.activation_bytes_per_gpu + failed.non_torch_bytes_per_gpu + failed.lora_bytes_per_gpu
    each = " each" if ranks > 1 else ""
    workers = f" for {ranks} tensor-parallel workers" if ranks > 1 else ""
    if failed.budget_bytes_per_gpu - failed.weight_bytes_per_gpu - reserve < GiB:
        why = (f"{r.model} ({r.weight_format}) needs {gib(failed.weight_bytes_per_gpu * ranks)} of weights, "
               f"{gib(reserve * ranks)} for activations and vLLM's processes and a KV cache of at least 1 GiB{each}"
               f"{workers}: more than the {request} of {CPU_MEMORY_FIELD}")
    else:
        why = (f"{request} of {CPU_MEMORY_FIELD} leaves a KV cache of {failed.cpu_kv_cache_gib} GiB{each}{workers} "
               f"beside {gib(failed.weight_bytes_per_gpu * ranks)} of weights: {failed.kv_cache_tokens} tokens, fewer "
               f"than one sequence of maxModelLen {r.max_model_len}")
    fixes: list[str] = []
    needed = _cpu_request_that_fits(r, failed)
    if needed is not None:
        fixes.append(f"request at least {needed}Gi there")
    if failed.longest_request >= 128:
        fixes.append(f"set spec.model.maxModelLen <= {failed.longest_request}")
    fixes.append("choose a GPU type")
    return SpecError(CPU_MEMORY_FIELD, f"{why}; {', or '.join(fixes)}")
