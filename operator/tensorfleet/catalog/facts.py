"""ModelFacts: everything the planner sizes a model with, whatever it was read from (`source`: hub, cache, file,
spec, catalog, catalog+id-markers), the architecture and the weights per decoder layer. `from_architecture` spreads
the totals the catalog and the spec know over the layers; `facts_to_json` / `facts_from_json` round-trip facts
exactly for status.modelFacts, and `facts_digest` names them. Pure data. Design:
docs/planner.md#where-the-facts-come-from."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from tensorfleet.api.architecture import ArchitectureSpec
from tensorfleet.catalog.formats import WeightFormat, standard

ModelSource = Literal["hub", "cache", "file", "spec", "catalog", "catalog+id-markers"]
MODEL_SOURCES: tuple[str, ...] = ("hub", "cache", "file", "spec", "catalog", "catalog+id-markers")
DEFAULT_VOCAB = 32000
EMBEDDING_BITS = 16.0  # embeddings, norms, biases and routers stay 16-bit under every format vLLM loads


@dataclass(frozen=True)
class LayerWeights:
    """The weights of one decoder layer.

    `linear` are the weights of its linear layers (attention projections, MLP,
    experts): what quantization converts. `bits` are the bits each is stored
    with, averaged over the layer (16 where a checkpoint leaves a module
    unquantized). `other` are norms, biases, router gates and attention sinks,
    always 16-bit. `replicated` are the linear weights vLLM keeps whole on every
    tensor rank instead of sharding (MLA's down-projections).
    """

    linear: float
    bits: float = 16.0
    other: int = 0
    replicated: int = 0

    @property
    def parameters(self) -> float:
        return self.linear + self.other

    def bytes(self, bits: float | None = None) -> float:
        """Bytes of the whole layer (all tensor ranks), at its own bits or BITS for every linear weight."""
        return self.linear * (bits if bits is not None else self.bits) / 8 + self.other * EMBEDDING_BITS / 8

    def bytes_per_gpu(self, tensor: int, bits: float | None = None) -> float:
        """Bytes one of TENSOR ranks holds: sharded weights split, replicated ones whole."""
        per_weight = (bits if bits is not None else self.bits) / 8
        sharded = (self.linear - self.replicated) * per_weight + self.other * EMBEDDING_BITS / 8
        return sharded / tensor + self.replicated * per_weight


@dataclass(frozen=True)
class ModelFacts:
    name: str
    arch: ArchitectureSpec
    weight_format: WeightFormat
    layers: tuple[LayerWeights, ...]
    embedding: int                     # input embedding parameters (vocab x hidden), 16-bit, first stage
    head: int                          # output head parameters, last stage; equal to `embedding` when tied
    source: ModelSource
    head_bits: float = EMBEDDING_BITS  # GPTQ checkpoints may quantize the head too
    final: int = 0                     # final norm, last stage
    encoder: int = 0                   # vision encoder and projector (16-bit), first stage
    revision: str | None = None        # the commit the config was read at, when known
    dtype: str | None = None           # the config's torch_dtype (bfloat16, float16, ...)
    notes: tuple[str, ...] = field(default=())

    @property
    def tied(self) -> bool:
        return self.arch.tied_embeddings

    @property
    def parameters(self) -> int:
        """Every parameter of the checkpoint as vLLM loads it (a tied head counted once)."""
        head = 0 if self.tied else self.head
        return round(sum(layer.parameters for layer in self.layers)) + self.embedding + head + self.final + self.encoder

    def weight_bytes(self, bits: float | None = None) -> int:
        """Bytes of all weights on one pipeline stage and tensor rank; BITS re-quantizes every linear weight."""
        head = 0 if self.tied else self.head * self.head_bits / 8
        layers = sum(layer.bytes(bits) for layer in self.layers)
        fixed = (self.embedding + self.final + self.encoder) * EMBEDDING_BITS / 8
        return int(layers + head + fixed)

    def with_source(self, source: ModelSource) -> ModelFacts:
        return replace(self, source=source)


def from_architecture(
    name: str, arch: ArchitectureSpec, weight_format: str | WeightFormat, source: ModelSource,
    notes: tuple[str, ...] = (),
) -> ModelFacts:
    """Facts from totals alone (the catalog, spec.model.architecture): the non-embedding
    parameters spread evenly over the layers, all at the format's bits."""
    fmt = standard(weight_format) if isinstance(weight_format, str) else weight_format
    embedding = (arch.vocab_size or DEFAULT_VOCAB) * arch.hidden_size
    embeddings = embedding * (1 if arch.tied_embeddings else 2)
    body = max(arch.parameters - embeddings, 0)
    layer = LayerWeights(linear=body / arch.layers, bits=fmt.bits)
    return ModelFacts(
        name=name, arch=arch, weight_format=fmt, layers=(layer,) * arch.layers, embedding=embedding,
        head=embedding, source=source, notes=notes,
    )


# --- as JSON (status.modelFacts.facts) ------------------------------------------------

FACTS_ENCODING = 1


class FactsEncodingError(ValueError):
    """A JSON document that facts_to_json did not write (another encoding, or altered)."""


def facts_to_json(facts: ModelFacts) -> dict[str, Any]:
    """FACTS as JSON-able data; facts_from_json reads them back equal.

    Numbers are written with their types fixed (floats stay floats), so the
    same facts always give the same document and digest, whatever numbers
    they were built from. The layers are run-length encoded, as
    [count, linear, bits, other, replicated]: a checkpoint has few kinds of layer.
    """
    layers: list[list[float | int]] = []
    for layer in facts.layers:
        row: list[float | int] = [float(layer.linear), float(layer.bits), int(layer.other), int(layer.replicated)]
        if layers and layers[-1][1:] == row:
            layers[-1][0] += 1
        else:
            layers.append([1, *row])
    return {
        "encoding": FACTS_ENCODING,
        "name": facts.name,
        "source": facts.source,
        "revision": facts.revision,
        "dtype": facts.dtype,
        "arch": facts.arch.model_dump(mode="json", by_alias=True, exclude_none=True),
        "weightFormat": {"name": facts.weight_format.name, "bits": float(facts.weight_format.bits),
                         "detail": facts.weight_format.detail},
        "layers": layers,
        "embedding": int(facts.embedding),
        "head": int(facts.head),
        "headBits": float(facts.head_bits),
        "final": int(facts.final),
        "encoder": int(facts.encoder),
        "notes": list(facts.notes),
    }


def facts_from_json(data: Any) -> ModelFacts:
    """The facts facts_to_json wrote; FactsEncodingError for anything else."""
    from pydantic import ValidationError

    try:
        if not isinstance(data, dict) or data.get("encoding") != FACTS_ENCODING:
            raise FactsEncodingError(f"not facts of encoding {FACTS_ENCODING}")
        source = data["source"]
        if source not in MODEL_SOURCES:
            raise FactsEncodingError(f"unknown source {source!r}")
        layers: list[LayerWeights] = []
        for count, linear, bits, other, replicated in data["layers"]:
            if not isinstance(count, int) or count < 1:
                raise FactsEncodingError(f"layer count {count!r}")
            layers += [LayerWeights(linear=float(linear), bits=float(bits), other=int(other),
                                    replicated=int(replicated))] * count
        fmt = data["weightFormat"]
        return ModelFacts(
            name=str(data["name"]),
            arch=ArchitectureSpec.model_validate(data["arch"]),
            weight_format=WeightFormat(str(fmt["name"]), float(fmt["bits"]), str(fmt.get("detail") or "")),
            layers=tuple(layers),
            embedding=int(data["embedding"]),
            head=int(data["head"]),
            source=source,
            head_bits=float(data["headBits"]),
            final=int(data["final"]),
            encoder=int(data["encoder"]),
            revision=data.get("revision"),
            dtype=data.get("dtype"),
            notes=tuple(str(n) for n in data.get("notes") or ()),
        )
    except FactsEncodingError:
        raise
    except (KeyError, TypeError, ValueError, ValidationError) as exc:
        raise FactsEncodingError(f"malformed facts: {type(exc).__name__}: {exc}") from None


def facts_digest(facts: ModelFacts) -> str:
    """`sha256:` and the hex digest of facts_to_json(FACTS), canonically serialized."""
    text = json.dumps(facts_to_json(facts), sort_keys=True, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()
