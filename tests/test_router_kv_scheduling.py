"""Cache-aware placing by what the engines report holding (the KV index fed by their KV events) rather than by
what this router remembers sending: later turns follow their conversation wherever another replica put it, a
shared system prompt held everywhere does not decide where a new conversation lives, an evicted conversation
no longer pulls, and the prompt work charged to an engine counts what it holds.
"""

from __future__ import annotations

from typing import Any

from test_router_strategies import backends, chat

from tensorfleet.prompts import goes_on, opening_chars, prompt_text
from tensorfleet.router.backends import Backend
from tensorfleet.router.kvindex import KVIndex
from tensorfleet.router.scheduling import CacheAware, RequestInfo, hash_prompt, make_profile

BLOCK = 16


def tokens_of(text: str) -> list[int]:
    """A stand-in tokenizer: one token per four characters, the same ids for the same text."""
    return [hash(text[i:i + 4]) % 50_000 for i in range(0, len(text), 4)]


def info_of(body: dict[str, Any]) -> RequestInfo:
    text, chars = prompt_text(body), opening_chars(body)
    hashes, opening, inside = hash_prompt(text, chars)
    return RequestInfo(prefix_hashes=hashes, opening=opening, opening_blocks=inside, prompt_chars=len(text),
                       continues=goes_on(text, chars), token_ids=tokens_of(text), opening_chars=chars or 0)


def store(index: KVIndex, engine: Backend, info: RequestInfo, upto: int | None = None) -> None:
    """The engine reports caching the prompt's whole blocks (the first UPTO tokens' worth)."""
    ids = (info.token_ids or [])[:upto]
    whole = len(ids) // BLOCK * BLOCK
    hashes = [f"{engine.url}#{i}" for i in range(whole // BLOCK)]
    index.stored(engine.url, hashes, None, ids[:whole], BLOCK)


def profile(index: KVIndex) -> CacheAware:
    chosen = make_profile("cache-aware")
    assert isinstance(chosen, CacheAware)
    chosen.use_kv_index(index)
    assert chosen.needs_tokens
    return chosen


def test_a_later_turn_follows_its_conversation_to_the_engine_holding_it() -> None:
    index, pool = KVIndex(), backends(4)
    first = info_of(chat("what is a KV cache?"))
    later = info_of(chat("what is a KV cache?", "blocks of keys and values " * 20, "and paging?"))
    # Another replica placed the first turn on pool[2], which is not this conversation's home here.
    home = make_profile("cache-aware").pick(pool, pool, first)
    elsewhere = next(b for b in pool if b is not home)
    store(index, elsewhere, later, upto=len(later.token_ids or []) - 8)
    for b in pool:   # the shared system prompt is everywhere
        store(index, b, first, upto=BLOCK * 4)
    assert profile(index).pick(pool, pool, later) is elsewhere
    # A replica without the index sends it home: the index is what makes replicas agree.
    assert make_profile("cache-aware").pick(pool, pool, later) is home
    # Once the engine evicted it, it no longer pulls.
    index.cleared(elsewhere.url)
    assert profile(index).pick(pool, pool, later) is home


def test_a_first_turn_is_not_placed_by_a_system_prompt_held_everywhere() -> None:
    index, pool = KVIndex(), backends(4)
    first = info_of(chat("a question nobody asked before"))
    held = profile(index)
    expected = make_profile("cache-aware").pick(pool, pool, first)
    lopsided = next(b for b in pool if b is not expected)
    store(index, lopsided, first, upto=BLOCK * 6)   # more of the shared system prompt on one engine
    assert held.pick(pool, pool, first) is expected


def test_a_prompt_that_is_not_a_chat_goes_where_the_longest_run_of_it_is_held() -> None:
    index, pool = KVIndex(), backends(3)
    text = "a long shared completion prompt " * 30
    info = RequestInfo(prefix_hashes=hash_prompt(text)[0], prompt_chars=len(text), token_ids=tokens_of(text))
    store(index, pool[0], info, upto=BLOCK * 2)
    store(index, pool[2], info, upto=BLOCK * 5)
    pool[2].own.requests = 3
    assert profile(index).pick(pool, pool, info) is pool[2]


def test_the_prompt_work_charged_counts_what_the_engine_holds() -> None:
    index, pool = KVIndex(), backends(2)
    info = info_of(chat("what is a KV cache?", "blocks " * 200, "and paging?"))
    store(index, pool[0], info, upto=BLOCK * 20)
    held = profile(index)
    ids = info.token_ids or []
    cached_chars = BLOCK * 20 * info.prompt_chars / len(ids)
    assert held.prefill_cost(pool[0], info) == info.prompt_chars - cached_chars
    assert held.prefill_cost(pool[1], info) == info.prompt_chars
    # Without token ids (the router could not get them) the profile places as without the index.
    blind = RequestInfo(prefix_hashes=info.prefix_hashes, prompt_chars=info.prompt_chars)
    assert held.prefill_cost(pool[0], blind) == info.prompt_chars


def test_only_cache_aware_reads_the_index() -> None:
    for name in ("round-robin", "least-pending", "session", "prefix-aware", "cache-aware"):
        chosen = make_profile(name)
        chosen.use_kv_index(KVIndex())
        assert chosen.needs_tokens == (name == "cache-aware"), name
