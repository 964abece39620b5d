"""Routing decisions, admission and circuit breakers, without sockets."""

from __future__ import annotations

import asyncio
import typing
from collections import Counter

import pytest

from tensorfleet import contract
from tensorfleet.api.models import RouterSpec
from tensorfleet.prompts import goes_on, opening_chars, prompt_text
from tensorfleet.router.backends import (
    CLOSED,
    HALF_OPEN,
    OPEN,
    Backend,
    BackendPool,
    BreakerPolicy,
    EngineMetrics,
    Load,
    parse_engine_metrics,
)
from tensorfleet.router.dispatch import Dispatcher, NoBackend, QueueTimeout
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
from tensorfleet.router.waitqueue import QueueFull


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


# --- breaker ----------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_breaker_ejects_probes_and_recovers() -> None:
    clock = Clock()
    pool = BackendPool(BreakerPolicy(failure_threshold=3, ejection_seconds=1.0, max_ejection_seconds=4.0), clock)
    pool.set_urls(["http://a", "http://b"])
    a = pool.backends["http://a"]
    pool.record_failure(a)
    pool.record_failure(a)
    assert a.state == CLOSED
    pool.record_failure(a)
    assert a.state == OPEN and [b.url for b in pool.routable()] == ["http://b"]
    until = a.breaker.open_until
    pool.record_failure(a)                        # late failures do not extend it
    assert a.breaker.open_until == until and a.breaker.ejections == 1
    clock.now += 1.0
    assert a in pool.routable()                   # half-open: one probe
    pool.begin_probe(a)
    assert a.state == HALF_OPEN and a not in pool.routable()
    pool.record_failure(a)                        # probe failed: longer ejection
    assert a.state == OPEN and a.breaker.open_until == clock.now + 2.0
    clock.now += 2.0
    pool.begin_probe(a)
    pool.record_success(a)
    assert a.state == CLOSED and a.breaker.ejections == 0
    pool.record_failure(a, fatal=True)            # connection refused: at once
    assert a.state == OPEN


def test_parse_engine_metrics() -> None:
    text = """# HELP vllm:num_requests_waiting x
vllm:num_requests_waiting{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting{engine="1",model_name="m"} 1.0
vllm:num_requests_running{engine="0",model_name="m"} 7.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.7
vllm:cache_config_info{block_size="16",engine="0",model_name="m",num_gpu_blocks="100"} 1.0
vllm:cache_config_info{block_size="16",engine="1",model_name="m",num_gpu_blocks="100"} 1.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="m"} 9.0
"""
    load = parse_engine_metrics(text)
    assert (load.waiting, load.running, load.kv_cache_tokens, load.kv_block_size) == (4.0, 7.0, 3200, 16)
    assert load.kv_usage == pytest.approx(0.6)
    assert parse_engine_metrics("").kv_cache_tokens is None


# --- dispatcher ---------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_dispatcher_charges_a_prompt_to_its_engine_until_the_first_byte() -> None:
    pool = BackendPool()
    pool.set_urls(["http://a", "http://b"])
    dispatcher = Dispatcher(pool, CacheAware(), ceiling=1, max_queue=4, queue_timeout=5)
    changes: list[tuple[int, float]] = []   # the load as each change of it is told (the router tells its peers)
    dispatcher.on_load = lambda: changes.append((sum(b.in_flight for b in pool), sum(b.own.prefill_chars for b in pool)))
    first = info_of(chat("a question " * 100))
    a = await dispatcher.acquire(first)
    assert a.own.prefill_chars == owed(dispatcher, a, first).prefill == first.prompt_chars > 0
    assert a.own.context_chars == owed(dispatcher, a, first).context == first.prompt_chars
    assert a.own.prefilling == 1 and a.own.requests == 1
    assert a.own.exposure == owed(dispatcher, a, first).exposure == first.exposure > 0   # from placement to its end
    dispatcher.discharge(a, first)                   # its first byte came back
    assert a.own.prefill_chars == 0 and owed(dispatcher, a, first).prefill == 0
    assert a.own.prefilling == 0 and a.own.requests == 1
    dispatcher.discharge(a, first)                   # a second first byte (a resumed stream) takes off nothing
    assert a.own.prefilling == 0 and a.own.requests == 1
    assert a.own.context_chars == first.prompt_chars     # its KV stays on the engine until it ends
    dispatcher.release(a, first)                     # nothing charged twice
    assert a.own.prefill_chars == 0 and a.in_flight == 0 and a.own.context_chars == 0 and len(dispatcher.ledger) == 0
    dispatcher.release(a, first)                     # released twice: a bug, logged, and no count goes below 0
    assert a.own == Load()
    assert changes == [(1, first.prompt_chars), (1, 0.0), (0, 0.0)]
    dispatcher.on_load = None
    # A strategy that never reads the charge is spared computing it.
    blind = Dispatcher(pool, make_profile("prefix-aware"), ceiling=1, max_queue=4, queue_timeout=5)
    other = info_of(chat("a question " * 100))
    c = await blind.acquire(other)
    assert c.own.prefill_chars == 0 and owed(blind, c, other).prefill == 0
    blind.release(c, other)
    # Released without a first byte (the engine failed, the client left): the charge goes with the slot.
    second = info_of(chat("another question " * 100))
    b = await dispatcher.acquire(second)
    dispatcher.release(b, second)
    assert b.own.prefill_chars == 0 and b.own.context_chars == 0
    # A waiter granted a slot just as it was cancelled gives back the slot and its charge.
    holders = [info_of(chat(f"hold {n} " * 50)) for n in range(2)]
    held = [await dispatcher.acquire(info) for info in holders]
    waiting = info_of(chat("a waiting question " * 100))
    waiter = asyncio.create_task(dispatcher.acquire(waiting))
    await asyncio.sleep(0)
    dispatcher.release(held[0], holders[0])          # the slot, and the waiter's charge, pass to the waiter
    assert held[0].own.prefill_chars == owed(dispatcher, held[0], waiting).prefill > 0
    waiter.cancel()
    await asyncio.gather(waiter, return_exceptions=True)
    assert held[0].own == Load() and dispatcher.ledger.get(held[0], waiting) is None


def owed(dispatcher: Dispatcher, backend: Backend, info: RequestInfo) -> Charge:
    """What INFO's request still adds to BACKEND's load: its prompt work until its first byte, its context and
    exposure until it ends."""
    charge = dispatcher.ledger.get(backend, info)
    if charge is None:
        return Charge()
    return charge if charge.prefilling else Charge(0.0, 0.0, charge.context, charge.exposure, prefilling=False)


def streamed(body: dict[str, object]) -> RequestInfo:
    info = info_of(body)
    info.queues_prompt = True
    return info


@pytest.mark.asyncio
async def test_cache_aware_holds_prompts_beyond_a_step_and_sends_each_to_the_first_engine_to_clear() -> None:
    pool = BackendPool()
    pool.set_urls(["http://a", "http://b"])
    dispatcher = Dispatcher(pool, CacheAware(), ceiling=8, queue_timeout=30, prompt_queue_chars=4000)
    first, second = streamed(chat("the first question " * 150)), streamed(chat("the second question " * 150))
    assert 2500 < first.prompt_chars < 4000 and 2500 < second.prompt_chars < 4000
    a = await dispatcher.acquire(first)
    b = await dispatcher.acquire(second)
    assert {a.url, b.url} == {"http://a", "http://b"}
    assert a.own.queued_prompt_chars == owed(dispatcher, a, first).queued == owed(dispatcher, a, first).prefill > 0
    # Each engine has most of a step's prompt to compute: a third prompt would only wait inside one of them, so it
    # waits here, and so does a short one behind it (it keeps its place in the queue, then goes cheapest first).
    third = streamed(chat("the third question, the longest of all " * 110))
    short = streamed(chat("a short one"))
    assert third.prompt_chars > 4000 and short.prompt_chars < 600
    waiting = [asyncio.create_task(dispatcher.acquire(info)) for info in (third, short)]
    await asyncio.sleep(0)
    assert not any(task.done() for task in waiting) and dispatcher.pending == 2
    assert a.in_flight == b.in_flight == 1            # held for the prompt bound, under the ceiling
    # The first prompt's first token: its engine has room again. The short prompt goes first; the long one, more
    # than a step by itself, goes only to an engine with nothing queued, and waits for the next to clear.
    dispatcher.discharge(a, first)
    await asyncio.sleep(0)
    assert waiting[1].done() and not waiting[0].done()
    assert waiting[1].result() is a and a.own.queued_prompt_chars == owed(dispatcher, a, short).queued
    dispatcher.discharge(b, second)
    await asyncio.sleep(0)
    assert waiting[0].result() is b and b.own.queued_prompt_chars == owed(dispatcher, b, third).queued
    # A prompt longer than a step goes to an engine that has none queued, alone.
    dispatcher.discharge(a, short)
    huge = streamed(chat("a document to read " * 400))
    assert huge.prompt_chars > 4000
    assert await dispatcher.acquire(huge) is a
    # A whole (not streamed) answer comes back only when its generation ends: it is placed by its prompt work
    # but not counted against the bound, and it is held like any other while no engine has room.
    dispatcher.discharge(b, third)
    whole = info_of(chat("a question answered whole " * 100))
    c = await dispatcher.acquire(whole)
    assert c is b and owed(dispatcher, b, whole).prefill > 0 and owed(dispatcher, b, whole).queued == 0
    assert b.own.queued_prompt_chars == 0
    # Released without a first token (the engine failed, the client left): its charge goes with the slot.
    dispatcher.release(a, huge)
    assert a.own.queued_prompt_chars == 0 and dispatcher.ledger.get(a, huge) is None


@pytest.mark.asyncio
async def test_the_prompt_bound_is_off_at_zero_and_for_strategies_that_do_not_place_by_prompt_work() -> None:
    for strategy, bound in ((CacheAware(), 0.0), (make_profile("round-robin"), 4000.0), (make_profile("least-pending"), 4000.0)):
        pool = BackendPool()
        pool.set_urls(["http://a"])
        dispatcher = Dispatcher(pool, strategy, ceiling=8, queue_timeout=1, prompt_queue_chars=bound)
        assert dispatcher.prompt_queue_chars == 0
        infos = [streamed(chat(f"question {n} " * 400)) for n in range(3)]
        engines = [await dispatcher.acquire(info) for info in infos]   # not one waits
        assert all(engine.url == "http://a" for engine in engines) and dispatcher.pending == 0


@pytest.mark.asyncio
async def test_a_later_turn_waits_for_its_engine_under_the_prompt_bound_rather_than_recompute_elsewhere() -> None:
    pool = BackendPool()
    pool.set_urls(["http://a"])
    strategy = CacheAware()
    dispatcher = Dispatcher(pool, strategy, ceiling=8, queue_timeout=30, prompt_queue_chars=4000)
    talk = "the fleet's history in detail " * 100
    opening = streamed(chat(talk))
    home = await dispatcher.acquire(opening)
    dispatcher.discharge(home, opening)
    dispatcher.release(home, opening)
    filler = streamed(chat("a new conversation about something else " * 70))
    assert await dispatcher.acquire(filler) is home
    pool.set_urls(["http://a", "http://b"])      # a second engine joins, with nothing queued
    other = next(b for b in pool if b is not home)
    # The next turn computes only its new message at home, which fits beside what is queued there: it goes home.
    follow_up = streamed(chat(talk, "an answer " * 20, "and one more question " * 5))
    assert home.own.queued_prompt_chars + strategy.prefill_cost(home, follow_up) <= 4000
    assert strategy.prefill_cost(other, follow_up) > 4000 - home.own.queued_prompt_chars
    assert await dispatcher.acquire(follow_up) is home
    # With no room left at home, the turn after waits for it (the other engine would compute the whole
    # history) and goes home once it clears.
    later = streamed(chat(talk, "an answer " * 20, "and one more question " * 5, "another answer " * 20,
                          "and a last question " * 40))
    assert home.own.queued_prompt_chars + strategy.prefill_cost(home, later) > 4000
    task = asyncio.create_task(dispatcher.acquire(later))
    await asyncio.sleep(0)
    assert not task.done() and other.in_flight == 0
    dispatcher.discharge(home, filler)
    await asyncio.sleep(0)
    assert task.done() and task.result() is home


async def _grant_order(dispatcher: Dispatcher, infos: list[RequestInfo], held: Backend,
                       held_info: RequestInfo) -> list[int]:
    """Queue INFOS (in this order) behind the one slot HELD, then free it again and again: the indexes of INFOS
    in the order they got the slot."""
    tasks = []
    for info in infos:
        tasks.append(asyncio.create_task(dispatcher.acquire(info)))
        await asyncio.sleep(0)
    order: list[int] = []
    current = held_info
    for _ in infos:
        dispatcher.release(held, current)
        await asyncio.sleep(0)
        done = [i for i, t in enumerate(tasks) if t.done() and i not in order]
        assert len(done) == 1, done
        order.append(done[0])
        current = infos[done[0]]
    return order


@pytest.mark.asyncio
async def test_cache_aware_gives_a_free_slot_to_the_waiter_with_the_least_prompt_work() -> None:
    pool = BackendPool()
    pool.set_urls(["http://a"])
    long, short, middle = (info_of(chat(f"question {n} " * words)) for n, words in ((0, 400), (1, 20), (2, 100)))
    dispatcher = Dispatcher(pool, CacheAware(), ceiling=1, queue_timeout=30)
    holder = info_of(chat("the request running now " * 10))
    a = await dispatcher.acquire(holder)
    # The shortest prompt first: at saturation it is the one most likely to get its first token in time.
    assert await _grant_order(dispatcher, [long, short, middle], a, holder) == [1, 2, 0]

    # Work, not length: a later turn of a conversation this engine holds computes only its new message.
    pool = BackendPool()
    pool.set_urls(["http://a"])
    strategy = CacheAware()
    dispatcher = Dispatcher(pool, strategy, ceiling=1, queue_timeout=30)
    talk = "the fleet's history in detail " * 60
    opening = info_of(chat(talk))
    a = await dispatcher.acquire(opening)
    follow_up = info_of(chat(talk, "an answer " * 20, "and one more question " * 5))
    stranger = info_of(chat("a new conversation, shorter in all " * 40))
    assert stranger.prompt_chars < follow_up.prompt_chars
    assert strategy.prefill_cost(a, follow_up) < strategy.prefill_cost(a, stranger)
    assert await _grant_order(dispatcher, [stranger, follow_up], a, opening) == [1, 0]


@pytest.mark.asyncio
async def test_a_waiter_that_waited_the_order_age_goes_first_and_other_strategies_keep_arrival_order() -> None:
    pool = BackendPool()
    pool.set_urls(["http://a"])
    long, short = info_of(chat("question " * 400)), info_of(chat("question " * 20))
    # Past the order age the oldest goes first whatever its prompt: nobody waits behind cheaper work forever.
    dispatcher = Dispatcher(pool, CacheAware(), ceiling=1, queue_timeout=30, order_age=0.05)
    holder = RequestInfo()
    a = await dispatcher.acquire(holder)
    tasks = [asyncio.create_task(dispatcher.acquire(info)) for info in (long, short)]
    await asyncio.sleep(0.1)
    dispatcher.release(a, holder)
    await asyncio.sleep(0)
    assert tasks[0].done() and not tasks[1].done()
    dispatcher.release(a, long)
    assert await tasks[1] is a
    # Round-robin and least-pending serve the queue in arrival order.
    for strategy in (make_profile("round-robin"), make_profile("least-pending")):
        pool = BackendPool()
        pool.set_urls(["http://a"])
        dispatcher = Dispatcher(pool, strategy, ceiling=1, queue_timeout=30)
        holder = RequestInfo()
        a = await dispatcher.acquire(holder)
        assert await _grant_order(dispatcher, [long, short], a, holder) == [0, 1]


@pytest.mark.asyncio
async def test_dispatcher_ceiling_queue_429_and_deadline() -> None:
    pool = BackendPool()
    pool.set_urls(["http://a"])
    dispatcher = Dispatcher(pool, make_profile("round-robin"), ceiling=1, max_queue=1, queue_timeout=0.2)
    infos = [RequestInfo(), RequestInfo()]
    first = await dispatcher.acquire(infos[0])
    waiter = asyncio.create_task(dispatcher.acquire(infos[1]))
    await asyncio.sleep(0)
    assert dispatcher.pending == 1
    with pytest.raises(QueueFull):
        await dispatcher.acquire(RequestInfo())
    dispatcher.release(first, infos[0])           # the slot passes to the waiter
    assert await waiter is first and first.in_flight == 1 and dispatcher.pending == 0
    with pytest.raises(QueueTimeout):
        await dispatcher.acquire(RequestInfo())
    assert dispatcher.pending == 0
    dispatcher.release(first, infos[1])
    assert first.in_flight == 0


@pytest.mark.asyncio
async def test_dispatcher_cancelled_waiter_leaves_no_trace() -> None:
    pool = BackendPool()
    pool.set_urls(["http://a"])
    dispatcher = Dispatcher(pool, make_profile("round-robin"), ceiling=1, max_queue=10, queue_timeout=5)
    holder = RequestInfo()
    held = await dispatcher.acquire(holder)
    waiter = asyncio.create_task(dispatcher.acquire(RequestInfo()))
    await asyncio.sleep(0)
    waiter.cancel()
    await asyncio.gather(waiter, return_exceptions=True)
    assert dispatcher.pending == 0
    dispatcher.release(held, holder)
    assert held.in_flight == 0


@pytest.mark.asyncio
async def test_dispatcher_retry_excludes_tried_engines() -> None:
    pool = BackendPool()
    pool.set_urls(["http://a", "http://b"])
    dispatcher = Dispatcher(pool, make_profile("round-robin"), ceiling=4, queue_timeout=1)
    a = await dispatcher.acquire(RequestInfo())
    b = await dispatcher.acquire(RequestInfo(), frozenset({a.url}))
    assert b is not a
    with pytest.raises(NoBackend):
        await dispatcher.acquire(RequestInfo(), frozenset({a.url, b.url}))


@pytest.mark.asyncio
@pytest.mark.parametrize("strategy", ["round-robin", "cache-aware"])
async def test_a_waiter_for_an_adapter_on_a_busy_engine_does_not_hold_up_the_queue(strategy: str) -> None:
    pool = BackendPool()
    pool.set_urls(["http://a", "http://b"])
    dispatcher = Dispatcher(pool, make_profile(strategy), ceiling=1, queue_timeout=5)
    adapter = RequestInfo(hosts=frozenset({"http://a"}), prompt_chars=100)   # only engine a lists its adapter
    holders = [RequestInfo(), RequestInfo()]
    held = [await dispatcher.acquire(info) for info in holders]
    on_a, on_a_info = next((b, i) for b, i in zip(held, holders, strict=True) if b.url == "http://a")
    on_b, on_b_info = next((b, i) for b, i in zip(held, holders, strict=True) if b.url == "http://b")
    first = asyncio.create_task(dispatcher.acquire(adapter))
    await asyncio.sleep(0)
    second = asyncio.create_task(dispatcher.acquire(RequestInfo(prompt_chars=5000)))
    await asyncio.sleep(0)
    dispatcher.release(on_b, on_b_info)   # engine b frees: the adapter's request cannot use it, the next one can
    assert await asyncio.wait_for(second, 1) is on_b
    assert not first.done()
    dispatcher.release(on_a, on_a_info)
    assert await asyncio.wait_for(first, 1) is on_a


@pytest.mark.asyncio
async def test_an_engine_with_room_bursts_past_the_ceiling_and_comes_back_when_it_queues() -> None:
    pool = BackendPool()
    pool.set_urls(["http://a"])
    dispatcher = Dispatcher(pool, make_profile("round-robin"), ceiling=4, burst=10, queue_timeout=5)
    (engine,) = pool
    infos = [RequestInfo() for _ in range(12)]
    held = [await dispatcher.acquire(info) for info in infos[:4]]
    waiters = [asyncio.create_task(dispatcher.acquire(info)) for info in infos[4:]]
    await asyncio.sleep(0)
    assert dispatcher.pending == 8 and dispatcher.burst_requests() == 0

    def scrape(running: float, waiting: float = 0.0, kv: float = 0.3) -> None:
        engine.scraped(EngineMetrics(waiting=waiting, running=running, kv_usage=kv))
        dispatcher.adapt(engine)

    # Room (nothing queued inside, cache below the high-water mark) while requests were held back: up a quarter,
    # and the waiters take the new slots at once.
    scrape(running=4)
    assert dispatcher.limit(engine) == 5 and engine.in_flight == 5 and dispatcher.pending == 7
    # Running beyond the ceiling is demand beyond what the replica is sized for.
    scrape(running=5)
    assert dispatcher.limit(engine) == 7 and engine.in_flight == 7
    assert dispatcher.burst_requests() == pytest.approx(5 - 4)  # as the engine last reported
    for _ in range(3):
        scrape(running=engine.in_flight)
    assert dispatcher.limit(engine) == 10 and engine.in_flight == 10 and dispatcher.pending == 2  # at the burst bound
    # The engine queues: the limit comes down (never below the ceiling); what is in flight finishes where it is.
    scrape(running=8, waiting=2)
    assert dispatcher.limit(engine) == 10 - 3
    assert dispatcher.burst_requests() == pytest.approx(8 - 4)  # what the engine runs beyond the ceiling, not its queue
    scrape(running=10, kv=0.95)
    assert dispatcher.limit(engine) == 7 - 2
    scrape(running=10, kv=0.95)
    assert dispatcher.limit(engine) == 4
    # A limit nobody needed is not raised: nothing was held back since the last scrape.
    for w in waiters[6:]:
        w.cancel()
    await asyncio.gather(*waiters[6:], return_exceptions=True)
    for backend, info in zip(held + [await w for w in waiters[:6]], infos, strict=False):
        dispatcher.release(backend, info)
    scrape(running=engine.in_flight)
    assert dispatcher.limit(engine) == 4 and engine.in_flight == 0


@pytest.mark.asyncio
async def test_without_burst_the_ceiling_holds_and_others_share_the_burst() -> None:
    pool = BackendPool()
    pool.set_urls(["http://a"])
    dispatcher = Dispatcher(pool, make_profile("round-robin"), ceiling=2, queue_timeout=5)
    (engine,) = pool
    holders = [RequestInfo(), RequestInfo()]
    held = [await dispatcher.acquire(info) for info in holders]
    waiter = asyncio.create_task(dispatcher.acquire(RequestInfo()))
    await asyncio.sleep(0)
    engine.scraped(EngineMetrics(running=2))
    dispatcher.adapt(engine)
    assert dispatcher.limit(engine) == 2 and dispatcher.pending == 1
    # Another router put 6 more there: 8 running against a ceiling of 2, and this router's share is 2 of 8.
    engine.scraped(EngineMetrics(running=8))
    assert dispatcher.burst_requests() == pytest.approx((8 - 2) * 2 / 8)
    waiter.cancel()
    await asyncio.gather(waiter, return_exceptions=True)
    for backend, info in zip(held, holders, strict=True):
        dispatcher.release(backend, info)


@pytest.mark.asyncio
async def test_dispatcher_auto_queue_scales_with_the_fleet() -> None:
    pool = BackendPool()
    pool.set_urls([f"http://{i}" for i in range(4)])
    assert Dispatcher(pool, make_profile("round-robin"), ceiling=100).max_queue == 800
    assert Dispatcher(pool, make_profile("round-robin"), ceiling=2).max_queue == 64
    # The ceiling sizes it, not the burst: a short queue answers a backlog with 429s at once rather than holding
    # hundreds of requests past any latency target (bench_autoscaling measured a longer one worse).
    assert Dispatcher(pool, make_profile("round-robin"), ceiling=16, burst=256).max_queue == 2 * 16 * 4


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
