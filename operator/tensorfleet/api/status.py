"""The InferenceService's status as the operator writes it (controller/status.py builds it): conditions, the
plan in use, the model's facts and the adapters. Part of the API models (models.py); see docs/api.md."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field
from pydantic.alias_generators import to_camel

from tensorfleet.api.base import ApiModel

ConditionStatus = Literal["True", "False", "Unknown"]


class Condition(ApiModel):
    type: str = Field(description="PlanValid, Progressing, Ready or Degraded.")
    status: ConditionStatus = Field(description="True, False or Unknown.")
    reason: str = Field(default="", description="CamelCase reason for the last transition.")
    message: str = Field(default="", description="Human-readable details.")
    last_transition_time: str | None = Field(default=None, description="When status last changed (RFC 3339).")
    observed_generation: int | None = Field(default=None, description="metadata.generation this condition was computed for.")


# Where a model's facts came from (catalog/facts.py MODEL_SOURCES says when each applies).
ModelSourceName = Literal["hub", "cache", "file", "spec", "catalog", "catalog+id-markers"]


class PlanStatus(ApiModel):
    accelerator: str = Field(description="GPU type planned for (CPU: vLLM's CPU backend).")
    tensor: int = Field(description="Tensor-parallel size in use.")
    pipeline: int = Field(description="Pipeline-parallel size in use.")
    gpus_per_replica: int = Field(description="tensor x pipeline (0 on CPU).")
    max_model_len: int = Field(description="Longest sequence in tokens.")
    weights_per_gpu: str = Field(description="Model weights held by each GPU (largest stage), e.g. 32.9Gi.")
    kv_cache_bytes_per_token: int = Field(description="KV-cache bytes per token on one GPU of the largest stage.")
    kv_cache_tokens: int = Field(description="Tokens of KV cache per replica (what vLLM logs as `GPU KV cache size`).")
    max_concurrent_sequences: int = Field(description="Sequences of maxModelLen tokens that fit in the KV cache at once.")
    load_seconds: int | None = Field(
        default=None,
        description="Estimated seconds from a replica's start to serving (engine start plus reading its weights), "
                    "which sizes the router's default cold-start timeout.",
    )
    model_source: ModelSourceName | None = Field(
        default=None,
        description=(
            "Where the model's facts came from: its config.json on the Hugging Face Hub (hub), in a local cache "
            "(cache), or given as a file (file); spec.model.architecture (spec); the built-in catalog (catalog), "
            "with the weight format read from quantization markers in the model id (catalog+id-markers)."
        ),
    )
    # LoRA (spec.adapters, spec.engine.lora): absent while it is off.
    max_loras: int | None = Field(
        default=None, exclude_if=lambda value: value is None,
        description="Adapters an engine holds in GPU slots at once (vLLM --max-loras), when LoRA is on: "
                    "spec.engine.lora.maxLoras, or the planner's choice.",
    )
    max_lora_rank: int | None = Field(
        default=None, exclude_if=lambda value: value is None,
        description="Largest adapter rank the engines take, which sizes every slot (vLLM --max-lora-rank), when LoRA is on.",
    )
    max_cpu_loras: int | None = Field(
        default=None, exclude_if=lambda value: value is None,
        description="Adapters an engine keeps in host memory (vLLM --max-cpu-loras), when LoRA is on.",
    )
    lora_memory_per_gpu: str | None = Field(
        default=None, exclude_if=lambda value: value is None,
        description="GPU memory each GPU gives the LoRA slots and their working buffers, taken from the KV cache "
                    "(kvCacheTokens is what is left), e.g. 0.3Gi; when LoRA is on.",
    )


class ModelFactsStatus(ApiModel):
    """The model facts the plan was made with, pinned (controller/modelfacts.py).

    Later reconciles, and the webhook for updates, plan from them and never
    read the Hugging Face Hub again while spec.model.name, spec.model.revision
    and the tensorfleet.dev/model-facts-refresh annotation stay as they were:
    a Hub that is down, or that answers differently later, cannot change a plan.
    """

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")

    model: str = Field(description="spec.model.name the facts were read for.")
    revision: str | None = Field(default=None, description="spec.model.revision they were read for (absent: the default branch).")
    refresh: str | None = Field(
        default=None,
        description="The tensorfleet.dev/model-facts-refresh annotation's value when they were read; "
                    "a new value makes the operator read them again.",
    )
    source: ModelSourceName = Field(description="Where they came from; status.plan.modelSource says the same.")
    commit: str | None = Field(default=None, description="The commit config.json was read at (source hub or cache).")
    hub_error: str | None = Field(
        default=None,
        description="Why they are not from the model's config.json: the Hub's error, when the operator asked it "
                    "and fell back to the built-in catalog.",
    )
    digest: str = Field(description="sha256 of the facts below, as the operator encodes them.")
    facts: dict[str, Any] = Field(
        description="The facts themselves (catalog/facts.py facts_to_json): architecture, weight format, "
                    "parameters per decoder layer.",
        json_schema_extra={"x-kubernetes-preserve-unknown-fields": True},
    )


class AdapterStatus(ApiModel):
    """Where one LoRA adapter of spec.adapters is loaded (controller/adapters.py)."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")

    name: str = Field(description="The adapter's name in spec.adapters.")
    state: Literal["Loaded", "Loading", "Failed", "Pending"] = Field(
        description=(
            "Loaded: every ready engine serves it. Loading: some ready engines do not yet. Failed: an engine "
            "refused it (message says why; the operator retries). Pending: no engine is ready to load it."
        ),
    )
    engines: int = Field(default=0, description="Ready engines that serve it.")
    ready_engines: int = Field(default=0, description="Ready engines in all.")
    message: str | None = Field(default=None, description="Why it failed, as the engine said, when it did.")


class TrafficMember(ApiModel):
    """One InferenceService of a traffic group, as the gateway splits new conversations between them."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")

    name: str = Field(description="The InferenceService.")
    share: str = Field(description="Its percent of new conversations by the weights (spec.traffic.weight), e.g. 10%.")
    conversations: int | None = Field(
        default=None,
        description="New conversations the gateway sent it since the gateway's pods started (with a gateway).",
    )
    observed_share: str | None = Field(
        default=None, description="Its percent of the group's counted conversations, e.g. 9.8% (with a gateway).",
    )


class TrafficStatus(ApiModel):
    """The traffic group this InferenceService is in at the gateway: every InferenceService of its namespace serving
    the same model name."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")

    group: str = Field(description="The model name the group serves (spec.model.servedName, else model.name).")
    members: list[TrafficMember] = Field(description="Each member's share by the weights, and what it got.")


class InferenceServiceStatus(ApiModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")

    observed_generation: int | None = Field(default=None, description="metadata.generation last reconciled.")
    conditions: list[Condition] = Field(default_factory=list, description="PlanValid, Progressing, Ready, Degraded.")
    replicas: int | None = Field(default=None, description="Model replicas (groups) that exist.")
    idle_since: str | None = Field(
        default=None,
        description=(
            "Set while the operator holds the fleet at zero (autoscaling.minReplicas 0, no request for "
            "scaleToZeroAfterSeconds): when it went idle. The next request clears it."
        ),
    )
    ready_replicas: int | None = Field(default=None, description="Groups whose every stage pod is ready.")
    prefill_replicas: int | None = Field(default=None, description="With spec.prefill: prefill engines that exist.")
    ready_prefill_replicas: int | None = Field(
        default=None,
        description="With spec.prefill: prefill engines that are ready. While fewer than wanted, decode engines "
                    "compute the prompts the prefill pool cannot take.",
    )
    updated_replicas: int | None = Field(default=None, description="Groups running the current spec.")
    selector: str | None = Field(default=None, description="Label selector of the leader pods (for the scale subresource and HPA).")
    endpoint: str | None = Field(default=None, description="OpenAI base URL inside the cluster.")
    plan: PlanStatus | None = Field(default=None, description="The capacity plan in force.")
    model_facts: ModelFactsStatus | None = Field(
        default=None, description="The model facts the plan was made with, pinned until the model named changes.",
    )
    adapters: list[AdapterStatus] | None = Field(
        default=None, description="Each LoRA adapter of spec.adapters: where it is loaded, or why it is not.",
    )
    traffic: TrafficStatus | None = Field(
        default=None,
        description="Its traffic group at the gateway (docs/gateway.md): the members' shares of new conversations.",
    )
