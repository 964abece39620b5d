"""A tiny Llama-architecture model made at test time, for real vLLM on a CPU: never downloaded.

`ensure()` (run by the test suite, stdlib only) returns the model's folder under the cache
($TF_E2E_CACHE or ~/.cache/tensorfleet, `models/tiny-llama-<hash>`), making it first when it is missing
by running this file as a script under the real-vLLM venv's python (`e2e/vllm-cpu python`), which has
torch, transformers, tokenizers and peft. The hash covers this file's text, so a change to the recipe
makes a new model. What is made: random weights, seeded (hidden 256, 2 layers, 4 heads of 64, 2 KV
heads: vLLM's CPU attention kernels need a supported head size), a byte-level BPE tokenizer trained on a
seeded synthetic corpus, a ChatML `chat_template`, and LoRA adapters of ranks 8, 16 and 32 under
`adapters/`, with random A and B so an adapter's answer differs from the base model's.
docs/real-engine.md has the long form.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HIDDEN = 256
LAYERS = 2
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 64
VOCAB = 1024
MAX_POSITIONS = 4096
ADAPTER_RANKS = {"tiny-lora-r8": 8, "tiny-lora-r16": 16, "tiny-lora-r32": 32}
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
EOS = "<|im_end|>"
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# The corpus the tokenizer is trained on: these words in seeded random sentences.
WORDS_TEXT = """
the model serves tokens from a cache of keys and values while the router sends each request to an engine with
room gpu node pod replica stage tensor pipeline parallel prefill decode batch queue adapter lora rank weight layer
head attention memory block page prefix hit miss stream chunk usage prompt completion chat message user assistant
system answer question number one two three four five six seven eight nine ten hundred thousand kubernetes operator
service autoscaler scale zero ready
"""


def cache_root() -> Path:
    return Path(os.environ.get("TF_E2E_CACHE") or Path.home() / ".cache" / "tensorfleet")


def recipe_hash() -> str:
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:12]


def model_dir(cache: Path | None = None) -> Path:
    return (cache or cache_root()) / "models" / f"tiny-llama-{recipe_hash()}"


def ensure(python: str, cache: Path | None = None, timeout: float = 600) -> Path:
    """The tiny model's folder, made first with `python` (the real-vLLM venv's) when missing."""
    target = model_dir(cache)
    if (target / "complete").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        done = subprocess.run([python, __file__, str(staging)], capture_output=True, text=True, timeout=timeout,
                              check=False)
        if done.returncode != 0:
            raise RuntimeError(f"making the tiny model failed ({python}): {done.stderr[-3000:]}")
        (staging / "complete").write_text(recipe_hash() + "\n")
        try:
            staging.rename(target)
        except OSError:  # made meanwhile by another process: theirs is the same model
            if not (target / "complete").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def corpus(lines: int = 4000) -> list[str]:
    import random

    rng = random.Random(1234)
    words = WORDS_TEXT.split()
    out = []
    for _ in range(lines):
        words = [rng.choice(words) for _ in range(rng.randint(4, 24))]
        out.append(" ".join(words).capitalize() + rng.choice([".", "?", "!", ","]))
    return out


def make(folder: Path) -> None:
    """Write the model, tokenizer and adapters into `folder` (run under the real-vLLM venv)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS, bos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>", unk_token=None)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
        max_position_embeddings=MAX_POSITIONS, bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id, tie_word_embeddings=False, torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder, safe_serialization=True)
    (folder / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": fast.bos_token_id, "eos_token_id": fast.eos_token_id, "do_sample": False}, indent=2))

    for name, rank in ADAPTER_RANKS.items():
        torch.manual_seed(rank)
        base = LlamaForCausalLM(config).to(torch.bfloat16)
        lora = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                          init_lora_weights=False, task_type="CAUSAL_LM")
        peft_model = get_peft_model(base, lora)
        out = folder / "adapters" / name
        peft_model.save_pretrained(out, safe_serialization=True)
        settings = json.loads((out / "adapter_config.json").read_text())
        settings["base_model_name_or_path"] = str(folder)
        (out / "adapter_config.json").write_text(json.dumps(settings, indent=2))


if __name__ == "__main__":
    make(Path(sys.argv[1]))
