"""Routing decisions, without sockets: the strategies (round-robin, least-pending, session, prefix-aware, the
default cache-aware, a scorer added as docs/routing.md shows) and the prompt hashing they place by. Admission and
the circuit breakers are in test_router_dispatch.py, which shares this module's request builders."""

from __future__ import annotations

import typing
from collections import Counter

from tensorfleet import contract
from tensorfleet.api.models import RouterSpec
from tensorfleet.prompts import goes_on, opening_chars, prompt_text
from tensorfleet.router.backends import (
    Backend,
    BackendPool,
    EngineMetrics,
    Load,
    parse_engine_metrics,
)
from tensorfleet.router.dispatch import Dispatcher
from tensorfleet.router.ledger import Charge
from tensorfleet.router.scheduling import (
    HOME_SLACK_CHARS,
    KV_HIGH_WATER,
    PREFIX_BLOCK_CHARS,
    PROFILES,
    CacheAware,
    RequestInfo,
    block_chars,
    exposure,
    has_room,
    hash_prompt,
    make_profile,
    prefix_hashes,
)
from tensorfleet.router.scheduling.prefixes import SentPrefixes
from tensorfleet.router.scheduling.request import UNSTATED_ANSWER_TOKENS
from tensorfleet.router.tokencount import stated_max_tokens


def backends(n: int) -> list[Backend]:
    return [Backend(f"http://10.0.0.{i}:8000") for i in range(n)]


def test_strategy_names_match_the_api_and_the_contract() -> None:
    literal = typing.get_args(RouterSpec.model_fields["strategy"].annotation)
    assert set(literal) == set(contract.ROUTER_STRATEGIES) == set(PROFILES)
    assert RouterSpec().strategy == contract.DEFAULT_ROUTER_STRATEGY


def test_round_robin_takes_turns() -> None:
    pool = backends(3)
    rr = make_profile("round-robin")
    picks = [rr.pick(pool, pool, RequestInfo()).url for _ in range(6)]
    assert picks == [b.url for b in pool] * 2


def test_least_pending_prefers_the_least_loaded_and_counts_engine_queues() -> None:
    a, b, c = pool = backends(3)
    a.own.requests, b.own.requests, c.own.requests = 5, 2, 3
    lp = make_profile("least-pending")
    assert lp.pick(pool, pool, RequestInfo()) is b
    # The engine says it is holding requests back: b is now worse than c.
    b.engine.waiting = 4
    assert lp.pick(pool, pool, RequestInfo()) is c
    # Equal engines share ties instead of one taking them all.
    for x in pool:
        x.own.requests, x.engine.waiting = 1, 0
    assert len({lp.pick(pool, pool, RequestInfo()).url for _ in range(6)}) == 3


def test_session_is_sticky_spread_and_bounded() -> None:
    pool = backends(4)
    session = make_profile("session")
    first = {f"user-{i}": session.pick(pool, pool, RequestInfo(session_key=f"user-{i}")).url for i in range(200)}
    again = {key: session.pick(pool, pool, RequestInfo(session_key=key)).url for key in first}
    assert again == first
    spread = Counter(first.values())
    assert len(spread) == 4 and min(spread.values()) > 20
    # Removing one engine moves only its sessions.
    gone = pool[0].url
    rest = pool[1:]
    moved = {k for k in first if session.pick(rest, rest, RequestInfo(session_key=k)).url != first[k]}
    assert moved == {k for k, url in first.items() if url == gone}
    # A hot session's engine over 1.25x the average load is skipped.
    hot = next(k for k, url in first.items() if url == pool[1].url)
    pool[1].own.requests = 10
    assert session.pick(pool, pool, RequestInfo(session_key=hot)) is not pool[1]
    # No key: least-pending.
    assert session.pick(pool, pool, RequestInfo()) is pool[0]


def test_prefix_aware_follows_the_prompt_and_respects_load() -> None:
    pool = backends(4)
    strategy = make_profile("prefix-aware")
    document = "You are a careful assistant. " * 40
    first = RequestInfo(prefix_hashes=prefix_hashes(prompt_text({"messages": [{"role": "system", "content": document},
                                                                             {"role": "user", "content": "q1"}]})))
    assert first.prefix_hashes
    chosen = strategy.pick(pool, pool, first)
    strategy.routed(chosen, first)
    # Another question over the same document lands on the same engine, even
    # when others are slightly less loaded.
    follow = RequestInfo(prefix_hashes=prefix_hashes(prompt_text({"messages": [
        {"role": "system", "content": document}, {"role": "user", "content": "q2 is different"}]})))
    chosen.own.requests = 1
    assert strategy.pick(pool, pool, follow) is chosen
    # Past the load bound it goes elsewhere.
    chosen.own.requests = 8
    assert strategy.pick(pool, pool, follow) is not chosen
    # An unrelated prompt goes to the least loaded.
    other = RequestInfo(prefix_hashes=prefix_hashes("something else entirely " * 30))
    assert strategy.pick(pool, pool, other) is not chosen


def test_prefix_index_is_bounded_by_engine_kv_capacity() -> None:
    backend = Backend("http://e:8000", EngineMetrics(kv_cache_tokens=6400))  # 100 blocks of 256 chars
    strategy = make_profile("prefix-aware")
    for i in range(50):
        strategy.routed(backend, RequestInfo(prefix_hashes=prefix_hashes(f"doc {i} " * 200)))
    prefixes = strategy.prefixes
    assert prefixes is not None
    assert prefixes.blocks(backend) == prefixes.capacity(backend) == 100
    strategy.forget(backend)
    assert prefixes.blocks(backend) == 0


# --- cache-aware (the default) ------------------------------------------------------------


def chat(*turns: str, system: str = "You answer questions about the fleet. " * 8) -> dict[str, object]:
    """A chat body whose user and assistant turns alternate, the way a client re-sends a conversation."""
    messages = [{"role": "system", "content": system}]
    for i, text in enumerate(turns):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": text})
    return {"messages": messages}


def info_of(body: dict[str, object], block: int = PREFIX_BLOCK_CHARS) -> RequestInfo:
    """What the router's app makes of a request body for a prefix strategy."""
    text, chars = prompt_text(body), opening_chars(body)
    hashes, opening, inside = hash_prompt(text, chars, block)
    return RequestInfo(prefix_hashes=hashes, opening=opening, opening_blocks=inside, prompt_chars=len(text),
                       continues=goes_on(text, chars), exposure=exposure(stated_max_tokens(body)))


def owed(dispatcher: Dispatcher, backend: Backend, info: RequestInfo) -> Charge:
    """What INFO's request still adds to BACKEND's load: its prompt work until its first byte, its context and
    exposure until it ends."""
    charge = dispatcher.ledger.get(backend, info)
    if charge is None:
        return Charge()
    return charge if charge.prefilling else Charge(0.0, 0.0, charge.context, charge.exposure, prefilling=False)


def test_prompt_hashes_are_stable_across_processes_and_chained() -> None:
    import subprocess
    import sys

    text = "a shared system prompt " * 40 + "then a question"
    code = ("from tensorfleet.router.scheduling import hash_prompt; "
            f"print(hash_prompt({text!r}, 300, 128))")
    # Another interpreter with another hash seed computes the same hashes: router replicas agree.
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={"PYTHONHASHSEED": "12345", "PATH": ""})
    assert other.stdout.strip() == str(hash_prompt(text, 300, 128))
    hashes, opening, inside = hash_prompt(text, 300, 128)
    assert len(hashes) == len(text) // 128 and inside == 300 // 128 == 2
    # A prompt that shares the first 300 characters shares the blocks inside them and the opening, nothing after.
    other_hashes, other_opening, _ = hash_prompt(text[:300] + "x" * 400, 300, 128)
    assert other_hashes[:2] == hashes[:2] and other_hashes[2] != hashes[2] and other_opening == opening
    assert hash_prompt(text, 301, 128)[1] != opening
    # Multi-byte text is hashed as UTF-8, with the opening counted in characters.
    accented = "é" * 200
    assert hash_prompt(accented, 100, 128)[2] == 1  # 100 characters are 200 bytes: one whole 128-byte block
    # The opening's hash is the CRC-32 of its bytes, whatever the script.
    import zlib
    for sample in (text, accented, "a question about ünïcode " * 30):
        assert hash_prompt(sample, 250)[1] == zlib.crc32(sample[:250].encode())


def test_hash_blocks_are_whole_kv_blocks() -> None:
    assert block_chars(None) == block_chars(16) == PREFIX_BLOCK_CHARS == 256
    assert block_chars(32) == block_chars(64) == block_chars(1) == 256
    assert block_chars(48) == 384 and block_chars(128) == 512


def test_the_opening_is_the_chat_through_its_first_user_message() -> None:
    body = chat("first question", "an answer", "second question")
    opening = opening_chars(body)
    assert opening is not None
    assert prompt_text(body)[:opening] == prompt_text(chat("first question"))[:opening]
    assert prompt_text(body)[:opening].endswith("first question<|end|>\n")
    assert opening_chars({"prompt": "a completion"}) is None
    assert opening_chars({"messages": [{"role": "system", "content": "no user yet"}]}) is None


def test_cache_aware_keeps_a_conversation_on_one_engine_and_replicas_agree() -> None:
    # Two router replicas, each with its own strategy and its own Backend objects for the same engines.
    replicas = [(CacheAware(), backends(4)) for _ in range(2)]
    homes = {}
    for i in range(40):
        turns = [f"question {i} about something"]
        chosen = set()
        for turn in range(3):
            # Turns alternate between the replicas, as a client-side split would send them.
            strategy, pool = replicas[turn % 2]
            info = info_of(chat(*turns))
            backend = strategy.pick(pool, pool, info)
            strategy.routed(backend, info)
            chosen.add(backend.url)
            turns += [f"answer {turn} " * 30, f"follow-up {turn}"]
        assert len(chosen) == 1, f"conversation {i} moved between engines: {chosen}"
        homes[i] = chosen.pop()
    spread = Counter(homes.values())
    assert len(spread) == 4 and min(spread.values()) >= 4, spread


def test_a_chat_goes_on_past_its_opening_once_it_holds_more_than_its_first_user_message() -> None:
    for body, later in ((chat("first question"), False), (chat("first question", "an answer", "second"), True),
                        (chat("first question", "an answer"), True)):
        assert goes_on(prompt_text(body), opening_chars(body)) is later
    assert not goes_on(prompt_text({"prompt": "a completion"}), None)


def test_cache_aware_places_a_first_turn_by_the_prompt_work_queued_ahead_of_it() -> None:
    strategy, pool = CacheAware(), backends(4)
    first = info_of(chat("a question " * 50))
    home = CacheAware().pick(pool, pool, first)     # an idle fleet: the home, for any replica
    assert strategy.pick(pool, pool, first) is home
    # The home is computing other prompts: the first turn goes where less prompt work waits, the least of it.
    home.own.prefill_chars = HOME_SLACK_CHARS + 1
    busy = {b.url: 5000.0 * (i + 1) for i, b in enumerate(pool) if b is not home}
    for b in pool:
        b.own.prefill_chars = busy.get(b.url, b.own.prefill_chars)
    least = min((b for b in pool if b is not home), key=lambda b: b.own.prefill_chars)
    assert least.own.prefill_chars > home.own.prefill_chars and strategy.pick(pool, pool, first) is home
    least.own.prefill_chars = 0.0
    assert strategy.pick(pool, pool, first) is least
    # Within the slack the home keeps it, so replicas that see slightly different loads still agree.
    least.own.prefill_chars = 1.0
    assert strategy.pick(pool, pool, first) is home
    # A later turn of a conversation this router has not seen goes home whatever its prefill: its KV is there.
    home.own.prefill_chars = 10 * HOME_SLACK_CHARS
    later = info_of(chat("a question " * 50, "an answer " * 20, "and then?"))
    assert later.continues and not first.continues
    assert strategy.pick(pool, pool, later) is home
    assert strategy.pick(pool, pool, first) is least


def test_cache_aware_starts_a_conversation_where_the_fewest_decodes_are_at_risk() -> None:
    strategy, pool = CacheAware(), backends(3)
    a, b, c = pool
    firsts = [info_of(chat(f"question number {n} " * 30)) for n in range(30)]
    # An idle fleet: each conversation at its home, so the first turns spread over every engine.
    assert {strategy.pick(pool, pool, info).url for info in firsts} == {a.url, b.url, c.url}
    # Three long answers decode on a (this router's); one short answer on b (another replica's, as it told); c
    # computes two prompts of unstated length within the slack. A prompt beside the short answer would stretch
    # its mean inter-token time the most, so b is the worst place for it, though it runs the fewest requests.
    a.own = Load(requests=3, exposure=3 * exposure(500))
    b.peers = Load(requests=1, exposure=exposure(9))
    c.own = Load(requests=2, prefilling=2, prefill_chars=HOME_SLACK_CHARS / 2, exposure=2 * exposure(None))
    assert a.exposure() < c.exposure() < b.exposure()
    assert {strategy.pick(pool, pool, info).url for info in firsts} == {a.url}
    # Once a's answers are short ones too, c has the fewest at risk.
    a.own = Load(requests=3, exposure=3 * exposure(20))
    assert {strategy.pick(pool, pool, info).url for info in firsts} == {c.url}
    # Decodes weigh only among engines within the slack of the least prompt work queued: the first token waits
    # for that work, whatever runs beside it. Of a and b, b's one short answer is less at risk than a's three.
    c.own = Load(requests=1, prefilling=1, prefill_chars=10 * HOME_SLACK_CHARS)
    assert {strategy.pick(pool, pool, info).url for info in firsts} == {b.url}
    # A later turn stays with its conversation's KV, however many decode there.
    later = info_of(chat("question number 0 " * 30, "an answer " * 20, "and then?"))
    strategy.routed(a, later)
    assert strategy.pick(pool, pool, later) is a


def test_a_requests_exposure_is_one_over_its_answers_gaps() -> None:
    assert exposure(9) == 1 / 8 and exposure(2) == 1.0
    # An answer of unstated length counts as a long one, less than any short stated answer.
    assert exposure(None) == 1 / (UNSTATED_ANSWER_TOKENS - 1) < exposure(100)
    # One token, none, or no generation at all (embeddings) has no gap between tokens to stretch.
    assert exposure(1) == exposure(0) == exposure(100, generates=False) == 0.0


def test_cache_aware_starts_a_conversation_on_an_engine_with_room_in_its_kv_cache() -> None:
    strategy, pool = CacheAware(), backends(4)
    for b in pool:
        b.engine.kv_cache_tokens = 10_000            # 40,000 characters of prompt
    first = info_of(chat("a question " * 50))
    home = CacheAware().pick(pool, pool, first)
    later = info_of(chat("a question " * 50, "an answer " * 20, "and then?"))
    # The prompts in flight on the home, this router's and its peers', nearly fill its cache: a new conversation
    # starts elsewhere (where nothing else is in its way, the next in its rendezvous order).
    home.own.context_chars, home.peers.context_chars = 20_000.0, 15_000.0 - first.prompt_chars
    assert has_room(home, first)
    assert strategy.pick(pool, pool, first) is home
    home.peers.context_chars += 1_000
    assert not has_room(home, first)
    elsewhere = strategy.pick(pool, pool, first)
    assert elsewhere is not home
    # ... and so does one whose engine said at its last scrape that its cache is past the high-water mark.
    home.own.context_chars = home.peers.context_chars = 0.0
    assert strategy.pick(pool, pool, first) is home
    home.engine.kv_usage = KV_HIGH_WATER
    assert strategy.pick(pool, pool, first) is elsewhere
    # A later turn goes home all the same: its history is cached there, and would be computed again elsewhere.
    assert strategy.pick(pool, pool, later) is home
    # No engine has room: the room does not decide (the load and the prompt work queued do).
    for b in pool:
        b.engine.kv_usage = 0.95
    assert strategy.pick(pool, pool, first) is home
    # An engine whose capacity is not scraped yet has room as far as the router can tell.
    fresh = backends(1)[0]
    fresh.own.context_chars = 1e9
    assert has_room(fresh, first)


def test_cache_aware_counts_a_shared_prefix_this_router_sent_as_work_already_done() -> None:
    strategy, pool = CacheAware(), backends(2)
    system = "a long shared system prompt " * 200   # ~5,600 characters: far more than the slack
    warm = info_of(chat("one tenant's question", system=system))
    other = info_of(chat("another question", system=system))
    home = CacheAware().pick(pool, pool, other)
    cold = next(b for b in pool if b is not home)
    strategy.routed(cold, warm)                      # the system prompt's blocks went to `cold` before
    # Its cost there is the prompt past the shared blocks; at home (nothing sent there), the whole prompt.
    assert strategy.prefill_cost(cold, other) < other.prompt_chars - len(system) + 256
    assert strategy.prefill_cost(home, other) == other.prompt_chars
    assert strategy.pick(pool, pool, other) is cold


class _CountingPrefixes(SentPrefixes):
    """The prefix memory counting its matches (each is a walk over the prompt's blocks)."""

    def __init__(self) -> None:
        super().__init__(openings=True)
        self.walks = 0

    def matched(self, backend: Backend, hashes: typing.Sequence[int]) -> int:
        self.walks += 1
        return super().matched(backend, hashes)


def test_cache_aware_matches_a_prompt_once_per_engine_for_a_pick_and_its_charge() -> None:
    strategy, pool, counting = CacheAware(), BackendPool(), _CountingPrefixes()
    strategy.prefixes = counting
    pool.set_urls([f"http://e{i}" for i in range(4)])
    opening = info_of(chat("what is a KV cache?"))
    dispatcher = Dispatcher(pool, strategy, ceiling=8)
    assert dispatcher.try_acquire(opening) is not None
    assert counting.walks == 4                # each engine once for the first turn's cost; the charge reuses it
    later = info_of(chat("what is a KV cache?", "blocks of keys and values " * 20, "and paging?"))
    counting.walks = 0
    backend = dispatcher.try_acquire(later)
    assert backend is not None and counting.walks == 1   # only the engine holding the conversation
    # Charged the prompt past the blocks the first turn sent there, as matched before this one was routed.
    prefill = owed(dispatcher, backend, later).prefill
    assert 0 < prefill < later.prompt_chars
    assert prefill == later.prompt_chars - later.matches[backend.url] * strategy.block_chars


def test_a_remembered_prefix_match_goes_stale_when_the_index_changes() -> None:
    profile, pool = CacheAware(), backends(2)
    strategy = profile.prefixes
    assert strategy is not None
    warm = info_of(chat("a question", system="a shared system prompt " * 40))
    other = info_of(chat("another question", system="a shared system prompt " * 40))
    assert strategy.match(pool[0], other) == 0
    profile.routed(pool[0], warm)
    shared = strategy.match(pool[0], other)
    assert shared > 0                                # routed: no longer 0
    profile.forget(pool[0])
    assert strategy.match(pool[0], other) == 0       # forgotten: 0 again
    profile.routed(pool[1], warm)
    assert SentPrefixes().match(pool[1], other) == 0   # another profile's memory: its own figure
    assert strategy.match(pool[1], other) == shared


def test_cache_aware_spills_over_a_saturated_home_and_follows_the_conversation_there() -> None:
    strategy = CacheAware()
    pool = backends(4)
    first = info_of(chat("what is a KV cache?"))
    home = strategy.pick(pool, pool, first)
    strategy.routed(home, first)
    # Its home is past the load bound (ceil(1.25 x 11 / 4) + 2 = 6): the next engine in the conversation's order.
    home.own.requests = 10
    second = info_of(chat("what is a KV cache?", "blocks of keys and values " * 20, "and paging?"))
    spill = strategy.pick(pool, pool, second)
    assert spill is not home
    strategy.routed(spill, second)
    # Once the home has room again, the conversation stays where its longest run of blocks now is.
    home.own.requests = 0
    third = info_of(chat("what is a KV cache?", "blocks of keys and values " * 20, "and paging?",
                         "pages of blocks " * 20, "thanks"))
    assert strategy.pick(pool, pool, third) is spill
    # Another replica that never saw it sends it home: the two agree again as soon as the home has room.
    other = CacheAware()
    assert other.pick(pool, pool, third).url == home.url


def test_cache_aware_counts_what_other_replicas_put_on_an_engine() -> None:
    a, b = pool = backends(2)
    strategy = CacheAware()
    # No conversation: the least loaded, counting the load another router put there (scraped).
    a.own.requests, b.own.requests = 1, 2
    a.scraped(parse_engine_metrics("vllm:num_requests_running 10\nvllm:num_requests_waiting 3\n"))
    b.scraped(parse_engine_metrics("vllm:num_requests_running 2\n"))
    assert (a.others, b.others) == (12.0, 0.0)
    assert strategy.pick(pool, pool, RequestInfo()) is b
    # The bound counts it too: a conversation whose home is `a` goes to `b` while `a` holds 13 requests
    # (bound: ceil(1.25 x 16 / 2) + 2 = 12).
    fresh = [Backend(x.url) for x in pool]
    info = next(i for i in (info_of(chat(f"q{n}")) for n in range(50))
                if CacheAware().pick(fresh, fresh, i).url == a.url)
    assert strategy.pick(pool, pool, info) is b
    a.scraped(parse_engine_metrics("vllm:num_requests_running 1\n"))  # the other router's requests are done
    assert strategy.pick(pool, pool, info) is a


def test_cache_aware_without_a_chat_follows_the_longest_prefix_else_the_least_loaded() -> None:
    strategy = CacheAware()
    pool = backends(3)
    prompt = "a long shared completion prompt " * 30
    info = RequestInfo(prefix_hashes=prefix_hashes(prompt))
    pool[0].own.requests, pool[1].own.requests, pool[2].own.requests = 2, 1, 3
    first = strategy.pick(pool, pool, info)
    assert first is pool[1]
    strategy.routed(first, info)
    pool[1].own.requests = 3
    longer = RequestInfo(prefix_hashes=prefix_hashes(prompt + "and more " * 20))
    assert strategy.pick(pool, pool, longer) is pool[1]
    assert strategy.pick(pool, pool, RequestInfo(prefix_hashes=prefix_hashes("unrelated " * 60))) is pool[0]


def test_the_index_follows_the_engines_block_size() -> None:
    strategy = CacheAware()
    backend = Backend("http://e:8000")
    strategy.routed(backend, info_of(chat("q")))
    strategy.align([16, 16, None])
    assert strategy.prefixes is not None
    assert strategy.block_chars == 256 and strategy.prefixes.blocks(backend)
    strategy.align([48, 48, 16])
    assert strategy.block_chars == 384 and not strategy.prefixes.blocks(backend)


def test_prompt_text_covers_chat_and_completions() -> None:
    assert "hello" in prompt_text({"messages": [{"role": "user", "content": [{"type": "text", "text": "hello"}]}]})
    assert prompt_text({"prompt": "abc"}) == "abc"
    assert prompt_text({"prompt": ["abc", "def"]}) == "abc"
    assert prompt_text({"prompt": [1, 2, 3]}) == "1 2 3"
    assert prompt_text({}) == ""


def test_a_scorer_added_as_docs_routing_shows_takes_part_in_the_pick() -> None:
    """docs/routing.md's example of adding a scorer, as written there."""
    from dataclasses import dataclass

    from tensorfleet.router.scheduling.filters import UnderLoadBound
    from tensorfleet.router.scheduling.profiles import Profile, Scored, Weighted, least_pending
    from tensorfleet.router.scheduling.scorers import LeastLoad

    @dataclass(frozen=True)
    class FreeKVCache:
        def scores(self, backends: typing.Sequence[Backend], routable: typing.Sequence[Backend],
                   info: RequestInfo) -> list[float]:
            return [1.0 - b.engine.kv_usage for b in backends]

    def kv_balanced() -> Profile:
        return Scored("kv-balanced", filters=[UnderLoadBound()],
                      scorers=[Weighted(LeastLoad(), 1.0), Weighted(FreeKVCache(), 0.5)],
                      fallback=least_pending())

    a, b = pool = backends(2)
    a.engine.kv_usage, b.engine.kv_usage = 0.8, 0.1
    assert kv_balanced().pick(pool, pool, RequestInfo()) is b
    a.own.requests = 0
    b.own.requests = 3   # load outweighs the free cache now
    assert kv_balanced().pick(pool, pool, RequestInfo()) is a
