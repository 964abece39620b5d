"""Weight formats: the stored bits per weight of the layers a format quantizes, scales and zero points included
(`BITS`), and the quantization markers of model ids (`id_format`), which the catalog reads only when no config.json
could be. Design: docs/planner.md#weight-formats."""

from __future__ import annotations

from dataclasses import dataclass

# Stored bits per quantized weight, scales and zero points included. The layers a format leaves alone (embeddings,
# output head, routers, norms, a checkpoint's ignore list) stay 16-bit: catalog/modelconfig.py works that out per
# module; the catalog's coarse facts charge every non-embedding parameter at these bits.
# fmt: off
BITS: dict[str, float] = {
    "bf16": 16.0,
    "fp16": 16.0,
    "fp8": 8.0,                                 # FP8 e4m3 (compressed-tensors, fp8, ModelOpt); + per-block scales
    "int8": 8.0,                                # INT8 weights: W8A8, W8A16 (compressed-tensors)
    "int4": 4 + 16 / 128,                       # W4A16 (compressed-tensors), a 16-bit scale per group of 128
    "awq": 4 + (16 + 4) / 128,                  # AWQ 4-bit, g128: fp16 scale + 4-bit zero
    "gptq": 4 + (16 + 4) / 128,                 # GPTQ 4-bit, g128: fp16 scale + packed zero
    "gptq-int8": 8 + (16 + 8) / 128,            # GPTQ 8-bit, g128
    "mxfp4": 4 + 8 / 32,                        # MXFP4 (gpt-oss's MoE experts): an 8-bit scale per 32
    "nvfp4": 4 + 8 / 16,                        # NVFP4: an fp8 scale per 16
    "bnb-4bit": 4 + 8 / 64 + 32 / (64 * 256),   # bitsandbytes NF4, blocks of 64, double-quantized
    "bnb-8bit": 8.0,                            # bitsandbytes LLM.int8
}
# fmt: on
UNQUANTIZED = frozenset({"bf16", "fp16"})
# The quantization family a format belongs to (what spec.model.quantization names).
FAMILY: dict[str, str] = {"gptq-int8": "gptq", "bnb-8bit": "bnb", "bnb-4bit": "bnb"}


def family(name: str) -> str:
    """The quantization family of a format: `gptq-int8` -> `gptq`; others are their own."""
    return FAMILY.get(name, name)


@dataclass(frozen=True)
class WeightFormat:
    """How a checkpoint's quantized weights are stored.

    `bits` are those of its quantized layers (scales included); `detail` says in
    words what was read (method, group size, the layers left 16-bit).
    """

    name: str
    bits: float
    detail: str = ""

    @property
    def quantized(self) -> bool:
        return self.name not in UNQUANTIZED

    @property
    def family(self) -> str:
        return family(self.name)


def standard(name: str) -> WeightFormat:
    """The format NAME with its usual parameters (group 128, and so on)."""
    return WeightFormat(name, BITS[name])


# --- model-id markers --------------------------------------------------------------

# Tokens (between -, _ or .) that name a variant of the same weights, not another
# architecture, and carry no format of their own.
VARIANT_TOKENS = frozenset({
    "instruct", "chat", "it", "hf", "base", "quantized", "dynamic", "static", "unsloth", "thinking",
    "w4a16", "w8a8", "w8a16", "int4", "int8", "fp8", "fp4", "nvfp4", "mxfp4", "awq", "gptq", "bnb", "4bit", "8bit",
})


def id_format(tokens: set[str]) -> str | None:
    """The weight format the quantization markers among TOKENS (lower case) name, or None: the markers RedHatAI,
    neuralmagic, Qwen, hugging-quants, unsloth and NVIDIA put in checkpoint names (`-W4A16`, `quantized.w4a16`,
    `-W8A8`, `-INT8`, `-FP8-dynamic`, `-AWQ`, `-GPTQ-Int4`, `-GPTQ-Int8`, `bnb-4bit`, `-FP4`, ...)."""
    if "awq" in tokens:
        return "awq"
    if "gptq" in tokens:
        return "gptq-int8" if "int8" in tokens else "gptq"
    if "bnb" in tokens or ("4bit" in tokens and "unsloth" in tokens):
        return "bnb-8bit" if "8bit" in tokens else "bnb-4bit"
    if "mxfp4" in tokens:
        return "mxfp4"
    if "nvfp4" in tokens or "fp4" in tokens:
        return "nvfp4"
    if "fp8" in tokens:
        return "fp8"
    if "w4a16" in tokens or "int4" in tokens:
        return "int4"
    if tokens & {"w8a8", "w8a16", "int8"}:
        return "int8"
    return None
