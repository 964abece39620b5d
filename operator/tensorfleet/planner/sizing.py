"""Sizing a fleet for a workload and latency targets, colocated or disaggregated, and which to pick. Pure:
`size(workload, targets, decode, prefill, arch)` takes the plans of one replica of each pool and answers how many
replicas each layout needs, what it costs in GPUs and which to choose, from the roofline of one engine step
(catalog/roofline.py), a Poisson decode batch and an Erlang C prefill queue. Design:
docs/disaggregation.md#sizing-the-split-for-a-target."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from tensorfleet.api.architecture import ArchitectureSpec
from tensorfleet.api.models import InferenceServiceSpec
from tensorfleet.catalog import ModelFacts, catalog_facts, find_gpu
from tensorfleet.catalog.roofline import (
    BANDWIDTH_EFFICIENCY,
    COMPUTE_EFFICIENCY,
    DEFAULT_PEAK_TFLOPS,
    PEAK_TFLOPS,
    STEP_OVERHEAD_SECONDS,
    TENSOR_PARALLEL_OVERHEAD_SECONDS,
)
from tensorfleet.planner.plan import Plan

# The one-sided 99th percentile of a normal distribution: the batch margin.
Z99 = 2.326
# The simulator's default KV link (sim/kvtransfer.py DEFAULT_LINK_GBPS), Gbit/s per GPU.
DEFAULT_LINK_GBPS = 100.0
CHUNK_STEP = 256
MAX_REPLICAS = 100_000
USER_PASSES = 30


class SizingError(ValueError):
    """A workload or target the sizing cannot use; `field` names the flag."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass(frozen=True)
class Workload:
    prompt_tokens: int
    output_tokens: int
    rate: float | None = None     # requests/s; or
    users: int | None = None      # concurrent users, each with one request at a time
    think_seconds: float = 0.0    # a user's pause between an answer and the next request

    def check(self) -> None:
        if (self.rate is None) == (self.users is None):
            raise SizingError("--rate", "give either --rate or --users")
        if self.rate is not None and not (math.isfinite(self.rate) and self.rate > 0):
            raise SizingError("--rate", f"{self.rate}: must be a positive number of requests per second")
        if self.users is not None and self.users < 1:
            raise SizingError("--users", f"{self.users}: must be at least 1")
        if not (math.isfinite(self.think_seconds) and self.think_seconds >= 0):
            raise SizingError("--think-seconds", f"{self.think_seconds}: must be 0 or more")
        if self.prompt_tokens < 1:
            raise SizingError("--prompt-tokens", f"{self.prompt_tokens}: must be at least 1")
        if self.output_tokens < 1:
            raise SizingError("--output-tokens", f"{self.output_tokens}: must be at least 1")

    def describe(self) -> str:
        load = (f"{self.rate:g} requests/s" if self.rate is not None else
                f"{self.users:,} concurrent users, think {self.think_seconds:g} s")
        return f"{load}, {self.prompt_tokens} prompt + {self.output_tokens} output tokens"


@dataclass(frozen=True)
class Targets:
    ttft_p99: float   # seconds
    itl_p99: float    # seconds

    def check(self) -> None:
        for flag, value in (("--ttft-p99", self.ttft_p99), ("--itl-p99", self.itl_p99)):
            if not (math.isfinite(value) and value > 0):
                raise SizingError(flag, f"{value}: must be a positive number of seconds")


@dataclass(frozen=True)
class Engine:
    """The roofline of one replica's engine step (sim/profile.py's Profile.step_seconds, from a Plan)."""

    accelerator: str
    tensor: int
    gpus: int
    weight_bytes_per_gpu: float
    kv_bytes_per_token_per_gpu: float
    kv_cache_tokens: int
    max_num_seqs: int
    max_num_batched_tokens: int
    bandwidth_bytes_per_s: float
    flops_per_s: float
    flops_per_token_per_gpu: float
    active_fraction: float = 1.0
    experts_touched_per_token: float = 1.0
    overhead_s: float = STEP_OVERHEAD_SECONDS

    def weight_bytes_read(self, tokens: int) -> float:
        if self.active_fraction >= 1.0:
            return self.weight_bytes_per_gpu
        touched = 1.0 - (1.0 - self.experts_touched_per_token) ** max(tokens, 1)
        return self.weight_bytes_per_gpu * min(self.active_fraction + (1.0 - self.active_fraction) * touched, 1.0)

    def step_seconds(self, decode_seqs: float, context_tokens: float, prefill_tokens: float) -> float:
        """One step with DECODE_SEQS sequences holding CONTEXT_TOKENS in all and a PREFILL_TOKENS chunk."""
        tokens = decode_seqs + prefill_tokens
        if tokens <= 0:
            return 0.0
        read = self.weight_bytes_read(math.ceil(tokens)) + context_tokens * self.kv_bytes_per_token_per_gpu
        compute = tokens * self.flops_per_token_per_gpu / self.flops_per_s
        return self.overhead_s + max(read / self.bandwidth_bytes_per_s, compute)


def model_arch(spec: InferenceServiceSpec, facts: ModelFacts | None) -> ArchitectureSpec | None:
    """The architecture the plan was sized with: spec.model.architecture, the facts read, else the catalog's."""
    if spec.model.architecture is not None:
        return spec.model.architecture
    if facts is not None:
        return facts.arch
    found = catalog_facts(spec.model.name)
    return found.arch if found is not None else None


def engine_for(plan: Plan, arch: ArchitectureSpec, max_num_batched_tokens: int | None = None) -> Engine:
    """The step timing of one replica PLAN describes, as the simulator would time it (sim/profile.py)."""
    gpu = find_gpu(plan.accelerator)
    bandwidth = gpu.bandwidth_gbps if gpu is not None else 1000
    active = arch.parameters
    touched = 1.0
    if arch.moe is not None:
        active = arch.moe.active_parameters or arch.parameters * arch.moe.experts_per_token // arch.moe.experts
        touched = arch.moe.experts_per_token / arch.moe.experts
    # A pipeline's stages run one after another: a step reads every stage's bytes on one rank's time.
    return Engine(
        accelerator=plan.accelerator,
        tensor=plan.tensor,
        gpus=plan.gpus_per_replica,
        weight_bytes_per_gpu=float(plan.weight_bytes_per_gpu * plan.pipeline),
        kv_bytes_per_token_per_gpu=float(plan.kv_bytes_per_token_per_gpu * plan.pipeline),
        kv_cache_tokens=plan.kv_cache_tokens,
        max_num_seqs=plan.max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens or plan.batched_tokens,
        bandwidth_bytes_per_s=bandwidth * 1e9 * BANDWIDTH_EFFICIENCY,
        flops_per_s=PEAK_TFLOPS.get(plan.accelerator, DEFAULT_PEAK_TFLOPS) * 1e12 * COMPUTE_EFFICIENCY,
        flops_per_token_per_gpu=2.0 * active / plan.tensor,
        active_fraction=min(active / arch.parameters, 1.0),
        experts_touched_per_token=touched,
        overhead_s=STEP_OVERHEAD_SECONDS + (TENSOR_PARALLEL_OVERHEAD_SECONDS if plan.tensor > 1 else 0.0),
    )


# --- the pieces --------------------------------------------------------------------


def mean_batch(cap: int) -> int:
    """The largest mean batch b whose p99 (Poisson: b + 2.33 sqrt(b)) stays within CAP."""
    b = cap
    while b > 0 and b + Z99 * math.sqrt(b) > cap:
        b -= 1
    return b


def decode_cap(engine: Engine, w: Workload, itl: float, chunk: int = 0) -> int:
    """The largest decode batch whose step (beside a CHUNK of prefill) meets ITL and whose sequences fit the
    KV cache at their longest and max_num_seqs (prefilling sequences count too)."""
    context = w.prompt_tokens + w.output_tokens / 2
    prefilling = math.ceil(chunk / w.prompt_tokens) if chunk else 0
    by_kv = engine.kv_cache_tokens // (w.prompt_tokens + w.output_tokens) - prefilling
    limit = min(engine.max_num_seqs - prefilling, by_kv)
    if limit < 1 or engine.step_seconds(1, context, chunk) > itl:
        return 0
    low, high = 1, limit
    while low < high:
        mid = (low + high + 1) // 2
        if engine.step_seconds(mid, mid * context, chunk) <= itl:
            low = mid
        else:
            high = mid - 1
    return low


def decode_limit(engine: Engine, w: Workload, chunk: int, cap: int) -> str:
    """Which bound set CAP (decode_cap's answer): the KV cache, max_num_seqs, or the ITL target."""
    prefilling = math.ceil(chunk / w.prompt_tokens) if chunk else 0
    if cap >= engine.kv_cache_tokens // (w.prompt_tokens + w.output_tokens) - prefilling:
        return "the KV cache"
    if cap >= engine.max_num_seqs - prefilling:
        return "max_num_seqs"
    return "the ITL target"


def erlang_c(servers: int, offered: float) -> float:
    """Probability that an arrival waits in an M/M/c queue with SERVERS and OFFERED load (rate / mu)."""
    if offered >= servers:
        return 1.0
    blocking = 1.0
    for n in range(1, servers + 1):
        blocking = offered * blocking / (n + offered * blocking)
    return servers * blocking / (servers - offered * (1 - blocking))


def wait_p99(servers: int, rate: float, mu: float) -> float:
    """The 99th percentile of the wait in an M/M/c queue (inf when it is overloaded):
    P(wait > t) = C e^-(c mu - rate) t, C the Erlang C probability of waiting at all."""
    if rate >= servers * mu:
        return math.inf
    waiting = erlang_c(servers, rate / mu)
    if waiting <= 0.01:
        return 0.0
    return math.log(waiting / 0.01) / (servers * mu - rate)


def chunks(engine: Engine) -> list[int]:
    top = engine.max_num_batched_tokens
    return sorted({*range(CHUNK_STEP, top + 1, CHUNK_STEP), top})


# --- results -----------------------------------------------------------------------


@dataclass(frozen=True)
class Pool:
    role: str                 # colocated | prefill | decode
    accelerator: str
    tensor: int
    gpus_per_replica: int
    replicas: int
    batched_tokens: int       # the step budget to run (--max-num-batched-tokens)
    decode_batch: int         # mean decode batch per engine (0: a prefill pool)
    decode_batch_p99: int     # the batch the ITL target is met at
    step_seconds: float       # the step at the mean batch (with its chunk)
    limit: str = ""           # what bounds decode_batch_p99: the ITL target, the KV cache or max_num_seqs

    @property
    def gpus(self) -> int:
        return self.replicas * self.gpus_per_replica

    def to_json(self) -> dict[str, object]:
        return {"role": self.role, "accelerator": self.accelerator, "tensor": self.tensor,
                "gpusPerReplica": self.gpus_per_replica, "replicas": self.replicas, "gpus": self.gpus,
                "maxNumBatchedTokens": self.batched_tokens, "decodeBatch": self.decode_batch,
                "decodeBatchP99": self.decode_batch_p99, "decodeBatchLimit": self.limit or None,
                "stepSeconds": round(self.step_seconds, 4)}


@dataclass(frozen=True)
class Layout:
    kind: str                       # colocated | disaggregated
    pools: tuple[Pool, ...]
    rate: float                     # requests/s it is sized for
    ttft_p99: float                 # estimates, seconds
    itl_p99: float
    problem: str | None = None      # why no size meets the targets; None: it does

    @property
    def feasible(self) -> bool:
        return self.problem is None

    @property
    def gpus(self) -> int:
        return sum(p.gpus for p in self.pools)

    def gpus_by_type(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for p in self.pools:
            out[p.accelerator] = out.get(p.accelerator, 0) + p.gpus
        return out

    def describe(self) -> str:
        if not self.feasible:
            return f"no size meets the targets: {self.problem}"
        pools = " + ".join(f"{'' if p.role == 'colocated' else p.role + ' '}{p.replicas} x tensor {p.tensor} on {p.accelerator}" for p in self.pools)
        return f"{pools} = {self.gpus} GPUs"

    def to_json(self) -> dict[str, object]:
        return {"kind": self.kind, "feasible": self.feasible, "problem": self.problem,
                "gpus": self.gpus if self.feasible else None, "gpusByType": self.gpus_by_type() if self.feasible else {},
                "rate": round(self.rate, 3), "ttftP99Seconds": _round(self.ttft_p99),
                "itlP99Seconds": _round(self.itl_p99), "pools": [p.to_json() for p in self.pools]}


def _round(value: float) -> float | None:
    return round(value, 4) if math.isfinite(value) else None


@dataclass(frozen=True)
class Sizing:
    workload: Workload
    targets: Targets
    link_gbps: float
    colocated: tuple[Layout, ...]     # one per GPU type of the fleet
    disaggregated: Layout
    choice: str                       # colocated | disaggregated | none
    chosen: Layout | None
    why: str

    def to_json(self) -> dict[str, object]:
        w = self.workload
        return {
            "workload": {"rate": w.rate, "users": w.users, "thinkSeconds": w.think_seconds,
                         "promptTokens": w.prompt_tokens, "outputTokens": w.output_tokens},
            "targets": {"ttftP99Seconds": self.targets.ttft_p99, "itlP99Seconds": self.targets.itl_p99},
            "kvTransferGbps": self.link_gbps,
            "colocated": [layout.to_json() for layout in self.colocated],
            "disaggregated": self.disaggregated.to_json(),
            "choice": self.choice,
            "why": self.why,
        }


# --- sizing one layout at one rate -------------------------------------------------


def _colocated(engine: Engine, w: Workload, t: Targets, rate: float) -> tuple[Layout, float]:
    """The fewest colocated replicas meeting both targets at RATE, and their mean response time. Every step is timed
    with its prefill chunk (under load prompts arrive all the time, so far more than 1% of steps carry one): the
    chunk that keeps such a step within the ITL target caps an engine, and each chunk is tried for the fewest
    replicas. An engine computes prompts at mu = chunk / (P x step) a second."""
    P, O = w.prompt_tokens, w.output_tokens
    options = []
    for chunk in chunks(engine):
        cap = decode_cap(engine, w, t.itl_p99, chunk)
        b = mean_batch(cap)
        if b < 1:
            continue
        step = engine.step_seconds(b, b * (P + O / 2), chunk)
        options.append((chunk, cap, b, step))
    if not options:
        single = engine.step_seconds(1, P + O / 2, min(CHUNK_STEP, engine.max_num_batched_tokens))
        return _failed("colocated", rate, f"a step with a {CHUNK_STEP}-token prefill chunk takes "
                                          f"{single * 1e3:.0f} ms on {engine.accelerator} x{engine.tensor}, over "
                                          f"the ITL target"), math.inf
    # The replicas each chunk needs: decode slots, then the prefill queue's TTFT.
    best: tuple[int, int, int, int, float, float] | None = None
    for chunk, cap, b, step in options:
        replicas = max(1, math.ceil(rate * O * step / b))
        mu = chunk / (P * step)
        service = math.ceil(P / chunk) * step
        if service > t.ttft_p99:
            continue
        replicas = max(replicas, math.floor(rate / mu) + 1)
        while replicas <= MAX_REPLICAS and service + wait_p99(replicas, rate, mu) > t.ttft_p99:
            replicas += 1
        if replicas > MAX_REPLICAS:
            continue
        if best is None or replicas < best[0]:
            best = (replicas, chunk, cap, b, step, service + wait_p99(replicas, rate, mu))
    if best is None:
        return _failed("colocated", rate, "no prefill chunk computes a prompt within the TTFT target "
                                          "beside a decode batch that meets the ITL target"), math.inf
    replicas, chunk, cap, b, _, ttft = best
    actual = _batch_at(engine, w, rate / replicas, chunk, b)
    step = engine.step_seconds(actual, actual * (P + O / 2), chunk)
    pool = Pool("colocated", engine.accelerator, engine.tensor, engine.gpus, replicas, cap + chunk, b, cap, step,
                decode_limit(engine, w, chunk, cap))
    itl = engine.step_seconds(cap, cap * (P + O / 2), chunk)
    return Layout("colocated", (pool,), rate, ttft, itl), math.ceil(P / chunk) * step + O * step


def _batch_at(engine: Engine, w: Workload, rate: float, chunk: int, limit: int) -> float:
    """The decode batch one engine settles at for RATE: b = rate x O x step(b) (Little's law)."""
    b = float(limit)
    for _ in range(40):
        b = min(float(limit), rate * w.output_tokens * engine.step_seconds(max(b, 1), max(b, 1) *
                                                                           (w.prompt_tokens + w.output_tokens / 2), chunk))
    return max(b, 1.0)


def _failed(kind: str, rate: float, problem: str) -> Layout:
    return Layout(kind, (), rate, math.inf, math.inf, problem)


def _disaggregated(prefill: Engine, decode: Engine, w: Workload, t: Targets, rate: float,
                   link_gbps: float) -> tuple[Layout, float]:
    P, O = w.prompt_tokens, w.output_tokens
    cap = decode_cap(decode, w, t.itl_p99)
    b = mean_batch(cap)
    if b < 1:
        single = decode.step_seconds(1, P + O / 2, 0)
        reason = (f"one decode step takes {single * 1e3:.0f} ms on {decode.accelerator} x{decode.tensor}, over the ITL "
                  "target" if single > t.itl_p99 else
                  f"the KV cache of {decode.kv_cache_tokens:,} tokens holds too few sequences of {P + O} tokens")
        return _failed("disaggregated", rate, reason), math.inf
    step = decode.step_seconds(b, b * (P + O / 2), 0)
    decode_replicas = max(1, math.ceil(rate * O * step / b))
    actual = _batch_at(decode, w, rate / decode_replicas, 0, b)
    decode_step = decode.step_seconds(actual, actual * (P + O / 2), 0)
    # Each tensor rank reads its share of the prompt's KV over its own link.
    transfer = P * decode.kv_bytes_per_token_per_gpu / (link_gbps * 1e9 / 8)
    budget = t.ttft_p99 - transfer - decode_step
    best: tuple[int, int, float, float] | None = None
    for chunk in chunks(prefill):
        pstep = prefill.step_seconds(0, 0, chunk)
        mu = chunk / (P * pstep)
        service = math.ceil(P / chunk) * pstep
        if service > budget:
            continue
        replicas = math.floor(rate / mu) + 1
        while replicas <= MAX_REPLICAS and service + wait_p99(replicas, rate, mu) > budget:
            replicas += 1
        if replicas > MAX_REPLICAS:
            continue
        if best is None or replicas < best[0]:
            best = (replicas, chunk, pstep, service + wait_p99(replicas, rate, mu))
    if best is None:
        one = prefill.step_seconds(0, 0, P)
        return _failed("disaggregated", rate, f"a {P}-token prompt takes {one * 1e3:.0f} ms on {prefill.accelerator} "
                                              f"x{prefill.tensor}, plus {transfer * 1e3:.0f} ms of KV transfer: "
                                              "over the TTFT target"), math.inf
    replicas, chunk, pstep, prefill_p99 = best
    pools = (
        Pool("prefill", prefill.accelerator, prefill.tensor, prefill.gpus, replicas, chunk, 0, 0, pstep),
        Pool("decode", decode.accelerator, decode.tensor, decode.gpus, decode_replicas,
             decode.max_num_batched_tokens, b, cap, decode_step, decode_limit(decode, w, 0, cap)),
    )
    itl = decode.step_seconds(cap, cap * (P + O / 2), 0)
    response = math.ceil(P / chunk) * pstep + transfer + O * decode_step
    return Layout("disaggregated", pools, rate, prefill_p99 + transfer + decode_step, itl), response


def _for_workload(sized: Callable[[float], tuple[Layout, float]], w: Workload, t: Targets) -> Layout:
    """Size at the workload's rate; for users, at the rate their response time gives by Little's law, rate =
    users / (think + response), a fixed point: each pass can only raise the rate, so only add replicas."""
    if w.rate is not None:
        return sized(w.rate)[0]
    assert w.users is not None
    # Start from the slowest response the targets allow (the lowest rate), then the one the layout delivers.
    response = t.ttft_p99 + w.output_tokens * t.itl_p99
    rate = w.users / (w.think_seconds + response)
    layout, response = sized(rate)
    for _ in range(USER_PASSES):
        if not layout.feasible:
            break
        wanted = w.users / (w.think_seconds + response)
        if wanted <= rate * 1.001:
            break
        rate = wanted
        layout, response = sized(rate)
    return layout


def size(workload: Workload, targets: Targets, decode: Engine, prefill: Engine,
         colocated: tuple[Engine, ...] = (), link_gbps: float = DEFAULT_LINK_GBPS) -> Sizing:
    """Size the colocated layouts (on COLOCATED engines, default: DECODE's) and the disaggregated one (PREFILL
    engines beside DECODE engines) for WORKLOAD and TARGETS, and pick one."""
    workload.check()
    targets.check()
    if not (math.isfinite(link_gbps) and link_gbps > 0):
        raise SizingError("--kv-transfer-gbps", f"{link_gbps}: must be a positive number of Gbit/s")
    engines = colocated or (decode,)

    def colocated_on(engine: Engine) -> Callable[[float], tuple[Layout, float]]:
        return lambda rate: _colocated(engine, workload, targets, rate)

    sizers = [*(colocated_on(e) for e in engines),
              lambda rate: _disaggregated(prefill, decode, workload, targets, rate, link_gbps)]
    layouts = [_for_workload(sized, workload, targets) for sized in sizers]
    if workload.users is not None:
        # Users send as fast as they are answered: size every layout for the highest rate any of them would see,
        # so that their GPU counts compare at the same requests per second.
        rate = max((x.rate for x in layouts if x.feasible), default=0.0)
        if rate > 0:
            layouts = [sized(rate)[0] for sized in sizers]
    together, split = tuple(layouts[:-1]), layouts[-1]
    best_together = min((x for x in together if x.feasible), key=lambda x: x.gpus, default=None)
    choice, chosen, why = _pick(best_together, split, targets)
    return Sizing(workload, targets, link_gbps, together, split, choice, chosen, why)


def _pick(together: Layout | None, split: Layout, t: Targets) -> tuple[str, Layout | None, str]:
    itl = f"{t.itl_p99 * 1e3:g} ms"
    if together is None and not split.feasible:
        return "none", None, "no layout meets both targets; relax them, or choose a faster GPU"
    if together is None:
        return "disaggregated", split, f"no colocated size meets both targets; {split.describe()}"
    pool = together.pools[0]
    detail = (f"colocated engines on {pool.accelerator} keep ITL p99 under {itl} only with prefill chunks of "
              f"{pool.batched_tokens - pool.decode_batch_p99} tokens beside a decode batch of {pool.decode_batch}")
    if not split.feasible:
        return "colocated", together, f"the split meets no size ({split.problem}); {together.describe()}"
    decode = split.pools[1]
    split_detail = (f"split, a decode engine runs a batch of {decode.decode_batch} at "
                    f"{decode.step_seconds * 1e3:.0f} ms a step")
    if split.gpus < together.gpus:
        return "disaggregated", split, (f"{split.gpus} GPUs against {together.gpus} colocated: {detail}, "
                                        f"so prefill stretches their steps; {split_detail}")
    return "colocated", together, (f"{together.gpus} GPUs against {split.gpus} split: {detail}, and "
                                   f"{split_detail}, so the split saves nothing" if together.gpus < split.gpus else
                                   f"{together.gpus} GPUs either way; one pool is simpler to run")
