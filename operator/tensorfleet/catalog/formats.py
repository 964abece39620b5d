"""Weight formats: how many bits a checkpoint stores per weight, and the quantization markers of model ids.

A format's `bits` are the stored bits per weight of the layers it quantizes,
scales and zero points included (a 4-bit weight with one 16-bit scale per group
of 128 costs 4 + 16/128 = 4.125 bits). The layers a format leaves alone (the
embeddings, the output head, routers, norms, and whatever a checkpoint's ignore
list names) stay 16-bit; `catalog/modelconfig.py` works that out per module
from a config.json, and the catalog's coarse facts charge every non-embedding
parameter at `bits`.

    name        what ships                                         bits per weight
    bf16/fp16   unquantized                                        16
    fp8         FP8 e4m3 (compressed-tensors, fp8, ModelOpt)       8 (+ per-block scales when blocked)
    int8        INT8 weights: W8A8, W8A16 (compressed-tensors)     8
    int4        INT4 weights, W4A16 (compressed-tensors), g128     4 + 16/128
    awq         AWQ 4-bit, g128, fp16 scale + 4-bit zero            4 + (16 + 4)/128
    gptq        GPTQ 4-bit, g128, fp16 scale + packed zero          4 + (16 + 4)/128
    gptq-int8   GPTQ 8-bit, g128                                   8 + (16 + 8)/128
    mxfp4       MXFP4 (gpt-oss MoE experts), 8-bit scale per 32    4 + 8/32
    nvfp4       NVFP4, fp8 scale per 16                             4 + 8/16
    bnb-4bit    bitsandbytes NF4, blocks of 64, double-quantized   4 + 8/64 + 32/(64 x 256)
    bnb-8bit    bitsandbytes LLM.int8                              8

Model ids: `id_format` reads the markers RedHatAI, neuralmagic, Qwen,
hugging-quants, unsloth and NVIDIA put in checkpoint names (`-W4A16`,
`quantized.w4a16`, `-W8A8`, `-INT8`, `-FP8-dynamic`, `-AWQ`, `-GPTQ-Int4`,
`-GPTQ-Int8`, `bnb-4bit`, `-FP4`, ...). The catalog uses it only when no config.json
could be read (the offline fallback); a config.json always wins.
"""

from __future__ import annotations

from dataclasses import dataclass

# fmt: off
BITS: dict[str, float] = {
    "bf16": 16.0,
    "fp16": 16.0,
    "fp8": 8.0,
    "int8": 8.0,
    "int4": 4 + 16 / 128,
    "awq": 4 + (16 + 4) / 128,
    "gptq": 4 + (16 + 4) / 128,
    "gptq-int8": 8 + (16 + 8) / 128,
    "mxfp4": 4 + 8 / 32,
    "nvfp4": 4 + 8 / 16,
    "bnb-4bit": 4 + 8 / 64 + 32 / (64 * 256),
    "bnb-8bit": 8.0,
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
    """The weight format the quantization markers among TOKENS (lower case) name, or None."""
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
