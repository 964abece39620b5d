"""What the scheduler may know about one request, parsed once by the router (the prompt's block hashes, its
conversation, its adapter). Design: docs/routing.md#the-scheduling-framework.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# The answer length assumed for a generation that states no max_tokens (vLLM's own default is the rest of the
# context): a long chat answer, so that its exposure (below) counts less than a short, stated one's.
UNSTATED_ANSWER_TOKENS = 256


def exposure(max_tokens: int | None, generates: bool = True) -> float:
    """How much a prompt computed beside a request stretches its mean inter-token time, for each second the prompt
    takes: 1 / (its answer's tokens - 1), its answer being MAX_TOKENS long (UNSTATED_ANSWER_TOKENS when None). A
    short answer has few inter-token gaps to spread one long step over; one token, or no generation, has none."""
    if not generates:
        return 0.0
    tokens = UNSTATED_ANSWER_TOKENS if max_tokens is None else max_tokens
    return 1.0 / (tokens - 1) if tokens > 1 else 0.0


@dataclass
class RequestInfo:
    session_key: str | None = None
    prefix_hashes: list[int] = field(default_factory=list)
    # The conversation's opening (through its first user message): its hash, and the whole blocks inside it.
    opening: int | None = None
    opening_blocks: int = 0
    # The rendered prompt's length in characters, and whether the chat goes on past its opening (an assistant
    # turn, or more, after the first user message): a first turn's KV is on no engine yet.
    prompt_chars: int = 0
    continues: bool = False
    # Whether the prompt counts in its engine's prompt queue (dispatch.py): its answer is streamed, so its first
    # token comes back as soon as the prompt is computed, and the engine computes it (a disaggregated request's
    # KV comes from a prefill engine instead).
    queues_prompt: bool = False
    # Its `exposure` to the prompts computed beside it on its engine (above): what it adds to the engine's decodes
    # at risk (Load.exposure) from its placement to its end.
    exposure: float = 0.0
    # Each engine's run of the prompt's leading blocks (by URL), computed once for a pick and the charge that
    # follows it; valid while the prefix memory is as it was (`matches_epoch`, see SentPrefixes.match).
    matches: dict[str, int] = field(default_factory=dict)
    matches_epoch: int = -1
    # A LoRA adapter's name, hashed: cache-aware keeps an adapter on the engines that hold it.
    adapter: int | None = None
    # The engines that list that adapter (their URLs), when the router knows: every profile sends the request
    # to one of them while any is routable, not to an engine that would answer 404 (one just started, say,
    # before the operator loaded its adapters). None: any engine.
    hosts: frozenset[str] | None = None
    # With the engines' KV events (router/kvindex.py): the prompt's token ids as the engines tokenize it, the
    # adapter's name (the index keys an adapter's blocks apart), the opening's length in characters; and the
    # leading tokens each engine holds (by URL), computed once per index version (`held_version`).
    token_ids: list[int] | None = None
    adapter_name: str | None = None
    opening_chars: int = 0
    held: dict[str, int] = field(default_factory=dict)
    held_version: int = -1
