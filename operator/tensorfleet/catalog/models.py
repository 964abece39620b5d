"""The built-in model catalog, the offline fallback: architecture facts of popular open models from their
config.json, with the exact parameter totals of the published checkpoints, found by the model id's base name once
variant suffixes are dropped (`find_model`; quantization markers among them set the weight format). Design:
docs/planner.md#the-built-in-catalog."""

from __future__ import annotations

import re
from dataclasses import dataclass

from tensorfleet.api.architecture import ArchitectureSpec, MLAArchitecture, MoEArchitecture
from tensorfleet.catalog.facts import ModelFacts, from_architecture
from tensorfleet.catalog.formats import VARIANT_TOKENS, id_format


@dataclass(frozen=True)
class ModelEntry:
    key: str                      # canonical normalised name, e.g. "llama-3.1-70b"
    display: str                  # a representative Hugging Face id
    arch: ArchitectureSpec
    aliases: tuple[str, ...] = ()  # other normalised names with the same architecture


def _arch(**facts: object) -> ArchitectureSpec:
    return ArchitectureSpec.model_validate(facts)


_LLAMA_31_8B = _arch(parameters=8_030_261_248, layers=32, hiddenSize=4096, attentionHeads=32, kvHeads=8, headDim=128,
                     intermediateSize=14336, vocabSize=128256, maxContextLength=131072)
_LLAMA_31_70B = _arch(parameters=70_553_706_496, layers=80, hiddenSize=8192, attentionHeads=64, kvHeads=8, headDim=128,
                      intermediateSize=28672, vocabSize=128256, maxContextLength=131072)
_DEEPSEEK_V3 = _arch(parameters=671_026_419_200, layers=61, hiddenSize=7168, attentionHeads=128, kvHeads=128, headDim=192,
                     intermediateSize=2048, vocabSize=129280, maxContextLength=163840, weightFormat="fp8",
                     moe=MoEArchitecture(experts=256, experts_per_token=8, shared_experts=1,
                                         active_parameters=37_000_000_000),
                     mla=MLAArchitecture(kv_lora_rank=512, qk_rope_head_dim=64))

MODELS: tuple[ModelEntry, ...] = (
    ModelEntry("llama-3.1-8b", "meta-llama/Llama-3.1-8B-Instruct", _LLAMA_31_8B, aliases=("llama-3-8b",)),
    ModelEntry("llama-3.1-70b", "meta-llama/Llama-3.1-70B-Instruct", _LLAMA_31_70B,
               aliases=("llama-3.3-70b", "llama-3-70b", "deepseek-r1-distill-llama-70b")),
    ModelEntry("llama-3.1-405b", "meta-llama/Llama-3.1-405B-Instruct", _arch(
        parameters=405_853_388_800, layers=126, hiddenSize=16384, attentionHeads=128, kvHeads=8, headDim=128,
        intermediateSize=53248, vocabSize=128256, maxContextLength=131072)),
    ModelEntry("llama-3.2-1b", "meta-llama/Llama-3.2-1B-Instruct", _arch(
        parameters=1_235_814_400, layers=16, hiddenSize=2048, attentionHeads=32, kvHeads=8, headDim=64,
        intermediateSize=8192, vocabSize=128256, tiedEmbeddings=True, maxContextLength=131072)),
    ModelEntry("llama-3.2-3b", "meta-llama/Llama-3.2-3B-Instruct", _arch(
        parameters=3_212_749_824, layers=28, hiddenSize=3072, attentionHeads=24, kvHeads=8, headDim=128,
        intermediateSize=8192, vocabSize=128256, tiedEmbeddings=True, maxContextLength=131072)),
    ModelEntry("qwen2.5-7b", "Qwen/Qwen2.5-7B-Instruct", _arch(
        parameters=7_615_616_512, layers=28, hiddenSize=3584, attentionHeads=28, kvHeads=4, headDim=128,
        intermediateSize=18944, vocabSize=152064, maxContextLength=32768)),
    ModelEntry("qwen2.5-14b", "Qwen/Qwen2.5-14B-Instruct", _arch(
        parameters=14_770_033_664, layers=48, hiddenSize=5120, attentionHeads=40, kvHeads=8, headDim=128,
        intermediateSize=13824, vocabSize=152064, maxContextLength=32768)),
    ModelEntry("qwen2.5-32b", "Qwen/Qwen2.5-32B-Instruct", _arch(
        parameters=32_763_876_352, layers=64, hiddenSize=5120, attentionHeads=40, kvHeads=8, headDim=128,
        intermediateSize=27648, vocabSize=152064, maxContextLength=32768)),
    ModelEntry("qwen2.5-72b", "Qwen/Qwen2.5-72B-Instruct", _arch(
        parameters=72_706_203_648, layers=80, hiddenSize=8192, attentionHeads=64, kvHeads=8, headDim=128,
        intermediateSize=29568, vocabSize=152064, maxContextLength=32768)),
    ModelEntry("qwen3-8b", "Qwen/Qwen3-8B", _arch(
        parameters=8_190_735_360, layers=36, hiddenSize=4096, attentionHeads=32, kvHeads=8, headDim=128,
        intermediateSize=12288, vocabSize=151936, maxContextLength=40960)),
    ModelEntry("qwen3-32b", "Qwen/Qwen3-32B", _arch(
        parameters=32_762_123_264, layers=64, hiddenSize=5120, attentionHeads=64, kvHeads=8, headDim=128,
        intermediateSize=25600, vocabSize=151936, maxContextLength=40960)),
    ModelEntry("qwen3-30b-a3b", "Qwen/Qwen3-30B-A3B", _arch(
        parameters=30_532_122_624, layers=48, hiddenSize=2048, attentionHeads=32, kvHeads=4, headDim=128,
        intermediateSize=768, vocabSize=151936, maxContextLength=40960,
        moe=MoEArchitecture(experts=128, experts_per_token=8, active_parameters=3_300_000_000))),
    ModelEntry("qwen3-235b-a22b", "Qwen/Qwen3-235B-A22B", _arch(
        parameters=235_093_634_560, layers=94, hiddenSize=4096, attentionHeads=64, kvHeads=4, headDim=128,
        intermediateSize=1536, vocabSize=151936, maxContextLength=40960,
        moe=MoEArchitecture(experts=128, experts_per_token=8, active_parameters=22_000_000_000))),
    ModelEntry("qwen3-235b-a22b-2507", "Qwen/Qwen3-235B-A22B-Instruct-2507", _arch(
        parameters=235_093_634_560, layers=94, hiddenSize=4096, attentionHeads=64, kvHeads=4, headDim=128,
        intermediateSize=1536, vocabSize=151936, maxContextLength=262144,
        moe=MoEArchitecture(experts=128, experts_per_token=8, active_parameters=22_000_000_000)),
        aliases=("qwen3-235b-a22b-instruct-2507", "qwen3-235b-a22b-thinking-2507")),
    ModelEntry("mistral-7b", "mistralai/Mistral-7B-Instruct-v0.3", _arch(
        parameters=7_248_023_552, layers=32, hiddenSize=4096, attentionHeads=32, kvHeads=8, headDim=128,
        intermediateSize=14336, vocabSize=32768, maxContextLength=32768)),
    ModelEntry("mixtral-8x7b", "mistralai/Mixtral-8x7B-Instruct-v0.1", _arch(
        parameters=46_702_792_704, layers=32, hiddenSize=4096, attentionHeads=32, kvHeads=8, headDim=128,
        intermediateSize=14336, vocabSize=32000, maxContextLength=32768,
        moe=MoEArchitecture(experts=8, experts_per_token=2, active_parameters=12_879_925_248))),
    ModelEntry("mixtral-8x22b", "mistralai/Mixtral-8x22B-Instruct-v0.1", _arch(
        parameters=140_630_071_296, layers=56, hiddenSize=6144, attentionHeads=48, kvHeads=8, headDim=128,
        intermediateSize=16384, vocabSize=32768, maxContextLength=65536,
        moe=MoEArchitecture(experts=8, experts_per_token=2, active_parameters=39_153_000_000))),
    ModelEntry("deepseek-v3", "deepseek-ai/DeepSeek-V3", _DEEPSEEK_V3,
               aliases=("deepseek-v3-0324", "deepseek-r1", "deepseek-r1-0528", "deepseek-v3.1")),
    ModelEntry("deepseek-v2-lite", "deepseek-ai/DeepSeek-V2-Lite", _arch(
        parameters=15_706_484_224, layers=27, hiddenSize=2048, attentionHeads=16, kvHeads=16, headDim=192,
        intermediateSize=1408, vocabSize=102400, maxContextLength=163840,
        moe=MoEArchitecture(experts=64, experts_per_token=6, shared_experts=2, active_parameters=2_400_000_000),
        mla=MLAArchitecture(kv_lora_rank=512, qk_rope_head_dim=64))),
    ModelEntry("gpt-oss-120b", "openai/gpt-oss-120b", _arch(
        parameters=116_829_156_672, layers=36, hiddenSize=2880, attentionHeads=64, kvHeads=8, headDim=64,
        intermediateSize=2880, vocabSize=201088, maxContextLength=131072, weightFormat="mxfp4",
        slidingWindow=128, slidingWindowLayers=18,
        moe=MoEArchitecture(experts=128, experts_per_token=4, active_parameters=5_130_000_000))),
    ModelEntry("llama-4-scout-17b-16e", "meta-llama/Llama-4-Scout-17B-16E-Instruct", _arch(
        # Vision encoder included; chunked attention is sized as full, as vLLM does by default.
        parameters=108_641_793_536, layers=48, hiddenSize=5120, attentionHeads=40, kvHeads=8, headDim=128,
        intermediateSize=8192, vocabSize=202048, maxContextLength=10485760,
        moe=MoEArchitecture(experts=16, experts_per_token=1, shared_experts=1, active_parameters=17_172_889_600))),
    ModelEntry("gemma-3-27b", "google/gemma-3-27b-it", _arch(
        parameters=27_432_406_640, layers=62, hiddenSize=5376, attentionHeads=32, kvHeads=16, headDim=128,
        intermediateSize=21504, vocabSize=262208, tiedEmbeddings=True, maxContextLength=131072,
        slidingWindow=1024, slidingWindowLayers=52)),
    ModelEntry("phi-4", "microsoft/phi-4", _arch(
        parameters=14_659_507_200, layers=40, hiddenSize=5120, attentionHeads=40, kvHeads=10, headDim=128,
        intermediateSize=17920, vocabSize=100352, maxContextLength=16384)),
    ModelEntry("gpt-oss-20b", "openai/gpt-oss-20b", _arch(
        parameters=20_914_757_184, layers=24, hiddenSize=2880, attentionHeads=64, kvHeads=8, headDim=64,
        intermediateSize=2880, vocabSize=201088, maxContextLength=131072, weightFormat="mxfp4",
        slidingWindow=128, slidingWindowLayers=12,
        moe=MoEArchitecture(experts=32, experts_per_token=4, active_parameters=3_610_000_000))),
)

_VERSION_SUFFIX = re.compile(r"-v\d+(\.\d+)*$")
_DATE_SUFFIX = re.compile(r"-\d{4}$")            # Qwen's -2507, DeepSeek's -0324
_LAST_TOKEN = re.compile(r"[-_.]([a-z0-9]+)$")

_BY_KEY: dict[str, ModelEntry] = {}
for _entry in MODELS:
    for _k in (_entry.key, *_entry.aliases):
        _BY_KEY[_k] = _entry


def normalise(model_name: str) -> tuple[str, str | None]:
    """(canonical key, weight format implied by the name's quantization markers, or None).

    Variant suffixes are peeled one at a time (`-v0.3`, `-2507`, and the tokens
    of catalog/formats.py's VARIANT_TOKENS, split at `-`, `_` or `.`), stopping at
    the first known key, so names such as `deepseek-v3` keep their own
    version-like suffix.
    """
    base = model_name.rstrip("/").rsplit("/", 1)[-1].lower().removeprefix("meta-")
    tokens: set[str] = set()
    while base not in _BY_KEY:
        stripped = _VERSION_SUFFIX.sub("", base)
        if stripped == base:
            last = _LAST_TOKEN.search(base)
            if last and last.group(1) in VARIANT_TOKENS:
                tokens.add(last.group(1))
                stripped = base[: last.start()]
            else:
                stripped = _DATE_SUFFIX.sub("", base)
        if stripped == base or not stripped:
            break
        base = stripped
    return base, id_format(tokens)


def find_model(model_name: str) -> tuple[ModelEntry | None, str | None]:
    """The catalog entry for a model name, and the weight format its name implies."""
    key, implied = normalise(model_name)
    return _BY_KEY.get(key), implied


def catalog_facts(model_name: str) -> ModelFacts | None:
    """The catalog's facts for MODEL_NAME (source `catalog`, or `catalog+id-markers` when
    quantization markers in the name set the weight format), or None if it is not known."""
    entry, implied = find_model(model_name)
    if entry is None:
        return None
    if implied is None:
        return from_architecture(model_name, entry.arch, entry.arch.weight_format, "catalog")
    note = f"weight format {implied} read from the model id (its config.json was not read)"
    return from_architecture(model_name, entry.arch, implied, "catalog+id-markers", notes=(note,))
