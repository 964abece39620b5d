"""The simulated engine: vLLM v1's continuous-batching scheduler on a clock (admission, chunked prefill, preemption
by recompute), a block-hashed prefix cache that can publish its KV events, answers drawn deterministically so a
resumed stream continues its own text, and the two halves of a disaggregated request. Design:
docs/simulator.md#the-scheduler."""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
import zlib
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tensorfleet.sim.lora import LoraState
from tensorfleet.sim.profile import Profile
from tensorfleet.sim.tokenizer import token_ids as ids_of
from tensorfleet.sim.validation import RequestRejected, rejected

__all__ = ["Engine", "RequestRejected", "SimRequest"]

log = logging.getLogger("tensorfleet.sim")

# Words of one token each under the simulator's tokenizer, so a streamed answer
# re-tokenizes to exactly the number of tokens reported in `usage`.
WORDS = tuple(
    " " + w for w in ["the", "of", "and", "to", "in", "is", "it", "that", "for", "on", "with", "as", "was", "at", "by", "be", "this", "are", "or", "from", "an", "not", "but", "all", "can", "had", "her", "one", "our", "out", "day", "get", "has", "him", "his", "how", "man", "new", "now", "old", "see", "two", "way", "who", "boy", "did", "its", "let", "put", "say", "she", "too", "use", "data", "node", "pod", "gpu", "fast", "load", "time", "real", "work", "test", "next", "safe"]
)
# Answer length when a request sets no max_tokens: a model stopping at EOS.
_DEFAULT_MIN_TOKENS, _DEFAULT_MEAN_TOKENS = 16, 128


_WORD_BYTES = {w: w.encode() for w in WORDS}


def greedy_words(context: str, seed: int, count: int) -> list[str]:
    """COUNT words continuing CONTEXT, each picked from the seed and every character before it (a running CRC-32
    of the context, then of each word as it is added): what comes after a text depends on nothing else, so the
    words after CONTEXT + the first k of them are the rest of them."""
    h = zlib.crc32(context.encode(), seed & 0xFFFFFFFF)
    words: list[str] = []
    for _ in range(count):
        word = WORDS[(((h * 0x9E3779B1) & 0xFFFFFFFF) >> 16) % len(WORDS)]
        words.append(word)
        h = zlib.crc32(_WORD_BYTES[word], h)
    return words


def hash_blocks(token_ids: Sequence[int], block_size: int, lora: str | None = None) -> list[int]:
    """Chained hashes of the full blocks of TOKEN_IDS, each covering every token before it and the adapter LORA
    (a LoRA request's blocks are its own, as in vLLM). Hashes of ints only, so the same in every process."""
    out: list[int] = []
    h = zlib.crc32(lora.encode()) + 1 if lora else 0
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        h = hash((h, tuple(token_ids[start:start + block_size])))
        out.append(h)
    return out


@dataclass(eq=False)
class SimRequest:
    """One request's state; the server reads tokens as they appear."""

    request_id: str
    prompt_tokens: Sequence[str]
    max_tokens: int
    block_hashes: list[int]          # chained hashes of the prompt's full blocks
    output_words: list[str]
    arrival: float
    finish_reason_if_done: str       # "length" when max_tokens was set, else "stop"
    token_ids: Sequence[int] = ()    # the prompt's ids (what block_hashes hash)
    sample_seed: int = 0             # what the answer was drawn with (the server derives logprobs from it)
    stop: tuple[str, ...] = ()       # stop strings
    include_stop: bool = False       # keep the stop string in the text (vLLM's include_stop_str_in_output)
    # Scheduler state.
    num_computed: int = 0            # tokens whose KV is in the cache
    held_hashes: int = 0             # leading block_hashes this request references
    uncached_blocks: int = 0         # other blocks it holds (partial tail, decode)
    admitted: bool = False
    first_token_at: float | None = None
    scheduled_at: float | None = None
    cached_tokens: int = 0           # prefix-cache hit on first admission
    remote_decode: bool = False      # prefill half of a disaggregated request: hold the KV when finished
    remote_tokens: int = 0           # decode half: leading prompt tokens whose KV was transferred here
    computed_prompt: int = 0         # prompt tokens computed here at first admission (neither cached nor sent)
    transfer_blocks: tuple[int, ...] = ()  # the ids its held KV blocks go by (the prefill half, once finished)
    lora: str | None = None          # the LoRA adapter it runs with (sim/lora.py)
    preemptions: int = 0
    # Output.
    generated: int = 0
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: str | None = None   # the stop string that ended it
    cut: int | None = None           # the text's length once a stop string ended it
    _wakeup: asyncio.Event = field(default_factory=asyncio.Event)
    _sampled: str = ""               # the text so far, kept only to look for stop strings in

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_tokens)

    @property
    def context_len(self) -> int:
        return self.prompt_len + self.generated

    @property
    def decoding(self) -> bool:
        """Only the last sampled token is left to process (one token per step)."""
        return self.generated > 0 and self.num_computed == self.context_len - 1

    @property
    def text(self) -> str:
        """The answer so far: its tokens' text, cut before the stop string that ended it."""
        text = "".join(self.output_words[: self.generated])
        return text if self.cut is None else text[: self.cut]

    @property
    def holdback(self) -> int:
        """Characters a stream must hold back until the request ends, as vLLM's detokenizer does: the end of
        the text could be the start of a stop string that is to be cut off."""
        return max(map(len, self.stop)) - 1 if self.stop and not self.include_stop else 0

    def hit_stop(self) -> bool:
        """Look for the stop strings where the newest token could complete one; on a hit, cut the text."""
        before = len(self._sampled)
        self._sampled += self.output_words[self.generated - 1]
        for stop in self.stop:
            at = self._sampled.find(stop, max(0, before - len(stop) + 1))
            if at != -1:
                self.stop_reason = stop
                self.cut = at + len(stop) if self.include_stop else at
                return True
        return False

    async def wait(self, seen: int) -> int:
        """Wait until more than `seen` tokens exist or the request ends; returns the count."""
        while self.generated <= seen and not self.finished:
            self._wakeup.clear()
            await self._wakeup.wait()
        return self.generated


def check_length(prompt_len: int, max_tokens: int | None, max_model_len: int, param: str = "max_tokens") -> None:
    """vLLM's length checks on a tokenized prompt (vllm/renderers/params.py): RequestRejected when MAX_TOKENS
    exceeds MAX_MODEL_LEN, or the prompt does not fit beside it. vLLM tokenizes at most one token more than fits,
    so a longer prompt is "at least" that long in its message."""
    wanted = max_tokens or 0
    if wanted > max_model_len:
        raise rejected(f"{param}={wanted}cannot be greater than max_model_len=max_total_tokens={max_model_len}. "
                       "Please request fewer output tokens.", param, wanted)
    room = max_model_len - wanted
    if prompt_len > room:
        count = min(prompt_len, room + 1)
        qualifier = "at least " if count == room + 1 else ""
        raise rejected(f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                       f"{wanted} output tokens and your prompt contains {qualifier}{count} input tokens, for a "
                       f"total of {qualifier}{count + wanted} tokens. Please reduce the length of the input prompt "
                       "or the number of requested output tokens.", "input_tokens", count)


class BlockPool:
    """KV blocks: referenced cached blocks, an LRU of unreferenced cached
    blocks (still hits until evicted), and anonymous blocks in use."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.refs: dict[int, int] = {}
        self.evictable: OrderedDict[int, None] = OrderedDict()
        self.anonymous = 0
        self.on_evict: Callable[[int], None] | None = None  # told of each cached block evicted (KV events)

    @property
    def used(self) -> int:
        """Blocks some request references (what vLLM reports as usage)."""
        return len(self.refs) + self.anonymous

    @property
    def free(self) -> int:
        """Blocks available to new allocations, evicting cached ones if needed."""
        return self.num_blocks - self.used

    def cached_prefix(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of `hashes` are in the cache."""
        count = 0
        for h in hashes:
            if h not in self.refs and h not in self.evictable:
                break
            count += 1
        return count

    def _make_room(self) -> None:
        # Unreferenced cached blocks are the only ones that occupy memory
        # without being in use; evict them oldest first.
        while self.used + len(self.evictable) >= self.num_blocks and self.evictable:
            evicted, _ = self.evictable.popitem(last=False)
            if self.on_evict is not None:
                self.on_evict(evicted)

    def acquire_hashed(self, h: int) -> bool:
        """Reference block H; True when it was not cached (it enters the cache now)."""
        if h in self.refs:
            self.refs[h] += 1
        elif h in self.evictable:
            del self.evictable[h]
            self.refs[h] = 1
        else:
            self._make_room()
            self.refs[h] = 1
            return True
        return False

    def acquire_anonymous(self, n: int) -> None:
        for _ in range(n):
            self._make_room()
            self.anonymous += 1

    def release(self, hashes: Sequence[int], anonymous: int, filled: Sequence[int] = ()) -> list[bool]:
        """Drop a request's references. `filled` names anonymous blocks that
        became full of computed tokens (its answer): they stay cached too.
        Per filled block, whether it entered the cache (was not cached yet)."""
        self.anonymous -= anonymous
        entered = [h not in self.refs and h not in self.evictable for h in filled]
        # Tail first into the LRU, as vLLM frees, so a prompt's head, the
        # part other prompts share, is evicted last.
        for h, new in zip(reversed(filled), reversed(entered), strict=True):
            if new:
                self.evictable[h] = None
        for h in reversed(hashes):
            count = self.refs[h] - 1
            if count:
                self.refs[h] = count
            else:
                del self.refs[h]
                self.evictable[h] = None
        return entered


@dataclass
class EngineStats:
    """Cumulative figures (the metrics layer mirrors them)."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    external_queries: int = 0        # prompt tokens of requests whose KV was to come from another engine
    external_hits: int = 0           # of those, tokens whose KV did arrive (not computed here)
    preemptions: int = 0
    finished: dict[str, int] = field(default_factory=dict)
    aborted: int = 0
    steps: int = 0
    step_seconds: float = 0.0        # simulated seconds of the steps run (the timing model's, not the wall clock's)
    max_running: int = 0
    max_waiting: int = 0


class Engine:
    """The scheduler loop and its queues. Create and use inside one event loop."""

    def __init__(self, profile: Profile, *, time_scale: float = 1.0, seed: int = 0,
                 clock: Callable[[], float] | None = None) -> None:
        if time_scale < 0:
            raise ValueError("time_scale must be >= 0")
        self.profile = profile
        self.time_scale = time_scale
        self.seed = seed
        self.pool = BlockPool(profile.num_blocks)
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.stats = EngineStats()
        self._ids = itertools.count()
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._clock = clock or asyncio.get_running_loop().time
        # Observers the metrics layer installs: (request) -> None.
        self.on_first_token: Callable[[SimRequest, float], None] | None = None
        self.on_finish: Callable[[SimRequest, float], None] | None = None
        self.on_abort: Callable[[], None] | None = None
        # KV held for another engine to read: its first block id -> (finished prefill request, hold expiry).
        self.held: dict[int, tuple[SimRequest, float]] = {}
        self._next_block_id = 1
        self.lora: LoraState | None = None  # with --enable-lora
        self._lora_seconds = 0.0            # bringing adapters into GPU slots costs the step that runs them
        self.hold_seconds = 480.0  # vLLM's VLLM_NIXL_ABORT_REQUEST_TIMEOUT, in simulated seconds
        # KV events (publish_kv_events): those of the step under way, or of work done between steps.
        self._publish: Callable[[list[list[Any]]], None] | None = None
        self._kv_pending: list[list[Any]] = []
        self._stepping = False
        self._flush_soon = False

    # --- lifecycle -----------------------------------------------------------
    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="sim-engine")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    # --- KV events -----------------------------------------------------------
    def publish_kv_events(self, publish: Callable[[list[list[Any]]], None]) -> None:
        """Hand PUBLISH each batch of KV events (vLLM's tagged arrays: BlockStored, BlockRemoved), one per engine
        step that changed the cache, and one per change made between steps (an abort, a transfer's release)."""
        self._publish = publish
        self.pool.on_evict = self._kv_removed

    def _kv_event(self, event: list[Any]) -> None:
        self._kv_pending.append(event)
        if not self._stepping and not self._flush_soon:
            # Outside a step (a client went away, a held transfer was read): its own batch, right after.
            self._flush_soon = True
            asyncio.get_running_loop().call_soon(self._flush_kv)

    def _kv_removed(self, block_hash: int) -> None:
        last = self._kv_pending[-1] if self._kv_pending else None
        if last is not None and last[0] == "BlockRemoved":
            last[1].append(block_hash)  # consecutive evictions: one event
        else:
            self._kv_event(["BlockRemoved", [block_hash], "GPU"])

    def _kv_stored(self, hashes: Sequence[int], entered: Sequence[bool], parent: int | None, ids: Sequence[int],
                   lora: str | None) -> None:
        """BlockStored for each run of consecutive blocks that ENTERED the cache among HASHES (IDS: their tokens;
        PARENT: the block before the first, None for a prompt's first), each run under the block before it."""
        if self._publish is None:
            return
        size = self.profile.block_size
        run = 0
        for i in range(len(hashes) + 1):
            if i < len(hashes) and entered[i]:
                continue
            if run < i:
                self._kv_event(["BlockStored", list(hashes[run:i]), hashes[run - 1] if run else parent,
                                list(ids[run * size:i * size]), size, None, "GPU", lora])
            run = i + 1

    def _flush_kv(self) -> None:
        self._flush_soon = False
        if self._kv_pending and self._publish is not None:
            batch, self._kv_pending = self._kv_pending, []
            self._publish(batch)

    # --- requests ------------------------------------------------------------
    def sample_seed(self, prompt_tokens: Sequence[str], seed: int | None, index: int = 0) -> int:
        """What a request's answer is drawn with: its prompt's last tokens, and its seed (the engine's when it
        has none) plus the index of its choice."""
        return zlib.crc32("".join(prompt_tokens[-64:]).encode()) ^ ((self.seed if seed is None else seed) + index)

    def submit(self, prompt_tokens: Sequence[str], max_tokens: int | None, *, request_id: str | None = None,
               seed: int | None = None, index: int = 0, output: Sequence[str] | None = None,
               stop: Sequence[str] = (), include_stop: bool = False,
               wakeup: asyncio.Event | None = None, remote_decode: bool = False, remote_tokens: int = 0,
               arrival: float | None = None, lora: str | None = None,
               max_tokens_param: str = "max_tokens", token_ids: Sequence[int] | None = None) -> SimRequest:
        """Queue a request; raises RequestRejected for ones vLLM would refuse.

        `index` is the choice's (seeds differ per choice); `output` the tokens of the answer to give, whole
        (structured output: it ends with "stop" unless max_tokens cuts it), instead of words drawn at random;
        `wakeup` an event to share with other requests (a request's choices, one waiter); `remote_decode` and
        `remote_tokens` the halves of a disaggregated request (sim/kvtransfer.py); `arrival` when it reached the
        server, if earlier than now (a decode half that waited for its KV); `lora` the adapter to run with;
        `max_tokens_param` what the request called max_tokens (chat's max_completion_tokens), for vLLM's errors;
        `token_ids` the prompt's ids when it came as ids (else those of PROMPT_TOKENS, sim/tokenizer.py)."""
        if lora is not None and (self.lora is None or lora not in self.lora.adapters):
            raise RequestRejected(f"The model `{lora}` does not exist.", "model", type_="NotFoundError", status=404)
        profile = self.profile
        prompt_len = len(prompt_tokens)
        room = profile.max_model_len - prompt_len
        if prompt_len == 0:
            raise RequestRejected("The prompt is empty; it must contain at least one token.", "prompt")
        check_length(prompt_len, max_tokens, profile.max_model_len, max_tokens_param)
        if max_tokens is None and room < 1:
            # vLLM gives such a request the rest of the context as max_tokens: none.
            raise rejected("max_tokens must be at least 1, got 0.", "max_tokens", 0)
        if max_tokens is not None and max_tokens < 1:
            raise rejected(f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens", max_tokens)
        if any(not isinstance(s, str) or not s for s in stop):
            raise RequestRejected("stop cannot contain an empty string.")
        # Deterministic per prompt and seed: the same request gets the same answer.
        sample_seed = self.sample_seed(prompt_tokens, seed, index)
        rng = random.Random(sample_seed)
        if output is not None:
            limit = room if max_tokens is None else max_tokens
            pieces = list(output) or [""]
            target, reason = (len(pieces), "stop") if len(pieces) <= limit else (limit, "length")
            words = pieces[:target]
        else:
            if max_tokens is None:
                target = min(room, _DEFAULT_MIN_TOKENS + int(rng.expovariate(1 / _DEFAULT_MEAN_TOKENS)))
                reason = "stop"
            else:
                target, reason = max_tokens, "length"
            # A fine-tune answers the same prompt differently from its base model.
            tuned = zlib.crc32(lora.encode()) if lora else 0
            words = greedy_words("".join(prompt_tokens), (self.seed if seed is None else seed) + index + tuned, target)
        ids = ids_of(prompt_tokens, profile.vocab_size) if token_ids is None else token_ids
        request = SimRequest(
            request_id=request_id or f"{next(self._ids):x}",
            prompt_tokens=prompt_tokens,
            token_ids=ids,
            max_tokens=target,
            block_hashes=hash_blocks(ids, profile.block_size, lora),
            output_words=words,
            arrival=self._clock() if arrival is None else arrival,
            finish_reason_if_done=reason,
            sample_seed=sample_seed,
            stop=tuple(stop),
            include_stop=include_stop,
            remote_decode=remote_decode,
            # The last prompt token is always computed here, for its logits.
            remote_tokens=max(0, min(remote_tokens, prompt_len - 1)),
            lora=lora,
        )
        if wakeup is not None:
            request._wakeup = wakeup
        fitted = profile.fitted
        delay = fitted.first_token_delay(bool(self.running or self.waiting)) if fitted is not None else 0.0
        if delay > 0 and self.time_scale > 0:
            # A calibrated profile's latency outside the engine loop (sim/profile.py): the request joins the
            # queue that much later, as a real engine's core sees it only after its API server is done with it.
            asyncio.get_running_loop().call_later(delay * self.time_scale, self._enqueue, request)
        else:
            self._enqueue(request)
        return request

    def _enqueue(self, request: SimRequest) -> None:
        if request.finished:  # aborted before it reached the queue
            return
        self.waiting.append(request)
        self.stats.max_waiting = max(self.stats.max_waiting, len(self.waiting))
        self._wakeup.set()

    def abort(self, request: SimRequest) -> None:
        """Drop a request whose client went away; frees its KV blocks now."""
        if request.finished:
            return
        if request.admitted:
            self._free(request)
            self.running.remove(request)
        else:
            try:
                self.waiting.remove(request)
            except ValueError:
                pass
        request.finished = True
        request.finish_reason = "abort"
        self.stats.aborted += 1
        if self.on_abort:
            self.on_abort()
        request._wakeup.set()

    # --- KV held for transfer (the prefill half) --------------------------------
    def release_transfer(self, block_ids: Sequence[int]) -> SimRequest | None:
        """The decode engine read the KV held in BLOCK_IDS: free the blocks. The request they held, or None when
        they are not held here (unknown, or the hold expired)."""
        self.expire_transfers()
        entry = self.held.get(block_ids[0]) if block_ids else None
        if entry is None or entry[0].transfer_blocks != tuple(block_ids):
            return None
        del self.held[block_ids[0]]
        request = entry[0]
        self._free(request)
        self._wakeup.set()  # blocks came free: admission may go on
        return request

    def expire_transfers(self) -> None:
        """Free the KV of holds nobody read in time."""
        now = self._clock()
        for handle in [h for h, (_, until) in self.held.items() if until <= now]:
            request, _ = self.held.pop(handle)
            self._free(request)

    def transfer_seconds(self, tokens: int, link_bytes_per_s: float) -> float:
        """Simulated seconds to move TOKENS tokens of KV to this engine: each GPU's share over its own link."""
        return tokens * self.profile.kv_bytes_per_token_per_gpu / link_bytes_per_s

    # --- gauges (read at scrape time) ----------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def kv_usage(self) -> float:
        return self.pool.used / self.pool.num_blocks if self.pool.num_blocks else 0.0

    # --- the scheduler -------------------------------------------------------
    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.profile.block_size)

    def _free(self, request: SimRequest) -> None:
        held = request.block_hashes[: request.held_hashes]
        filled: list[int] = []
        size = self.profile.block_size
        full = request.num_computed // size
        if request.generated and request.held_hashes == len(request.block_hashes) and full > len(held):
            # Blocks the answer filled are cached as vLLM caches them, so the
            # next turn of a conversation, which re-sends it, hits on them.
            tokens = [*request.token_ids, *ids_of(request.output_words[: request.generated], self.profile.vocab_size)]
            filled = hash_blocks(tokens, size, request.lora)[len(held):full]
            entered = self.pool.release(held, request.uncached_blocks, filled)
            self._kv_stored(filled, entered, held[-1] if held else None, tokens[len(held) * size:], request.lora)
        else:
            self.pool.release(held, request.uncached_blocks)
        request.held_hashes = 0
        request.uncached_blocks = 0
        request.num_computed = 0
        request.admitted = False

    def _preempt(self, victim: SimRequest) -> None:
        self._free(victim)
        self.running.remove(victim)
        victim.preemptions += 1
        self.stats.preemptions += 1
        self.waiting.appendleft(victim)

    def _grow(self, request: SimRequest, tokens: int) -> bool:
        """Give `request` blocks for `tokens` tokens of context, preempting the
        newest running requests if needed; False if `request` itself was."""
        need = self._blocks_for(tokens) - request.held_hashes - request.uncached_blocks
        while need > self.pool.free:
            victim = self.running[-1]
            self._preempt(victim)
            if victim is request:
                return False
        if need > 0:
            self.pool.acquire_anonymous(need)
            request.uncached_blocks += need
        return True

    def _try_admit(self, request: SimRequest) -> bool:
        profile = self.profile
        hashes = request.block_hashes
        hit_blocks = self.pool.cached_prefix(hashes)
        # The last token is always computed, for its logits, so hits stop at
        # the last whole block before it (vLLM's max_cache_hit_length).
        hit_blocks = min(hit_blocks, (request.context_len - 1) // profile.block_size)
        hit_tokens = hit_blocks * profile.block_size
        remote = request.remote_tokens > hit_tokens and request.scheduled_at is None
        if remote:
            # Transferred KV lands in blocks of its own: no cache hit is taken (their blocks are allocated
            # below like any computed ones); the tokens count as computed.
            hit_blocks, hit_tokens = 0, request.remote_tokens
        total = self._blocks_for(request.context_len)
        fresh_hashed = len(hashes) - hit_blocks
        anonymous = total - len(hashes)
        # Hit blocks sitting in the LRU become referenced: they stop counting as free.
        hit_evictable = sum(1 for h in hashes[:hit_blocks] if h not in self.pool.refs)
        if fresh_hashed + anonymous + hit_evictable > self.pool.free:
            return False
        entered = [self.pool.acquire_hashed(h) for h in hashes]
        self._kv_stored(hashes, entered, None, request.token_ids, request.lora)
        self.pool.acquire_anonymous(anonymous)
        request.held_hashes = len(hashes)
        request.uncached_blocks = anonymous
        request.num_computed = hit_tokens
        request.admitted = True
        if request.scheduled_at is None:
            stats = self.stats
            request.scheduled_at = self._clock()
            stats.prompt_tokens += request.prompt_len
            stats.prefix_queries += request.prompt_len
            if remote:
                stats.external_queries += request.prompt_len
                stats.external_hits += hit_tokens
            else:
                stats.prefix_hits += hit_tokens
            request.cached_tokens = hit_tokens  # vLLM's num_cached_tokens: local and transferred
            request.computed_prompt = request.prompt_len - hit_tokens
        return True

    def _schedule(self) -> list[tuple[SimRequest, int]]:
        """One step's work as (request, new tokens) pairs, vLLM v1 style: every
        request computes what it lacks, `context_len - num_computed` tokens
        (one when decoding, a chunk of the prompt when prefilling)."""
        profile = self.profile
        budget = profile.max_num_batched_tokens
        work: list[tuple[SimRequest, int]] = []
        for request in list(self.running):
            if budget <= 0:
                break
            if not request.admitted:  # preempted by an earlier request's growth
                continue
            chunk = min(request.context_len - request.num_computed, budget)
            if self._grow(request, request.num_computed + chunk):
                work.append((request, chunk))
                budget -= chunk
        lora = self.lora
        active = {r.lora for r in self.running if r.lora} if lora is not None else set()
        skipped: list[SimRequest] = []  # waiting for an adapter slot: they keep their place in the queue
        while self.waiting and budget > 0 and len(self.running) < profile.max_num_seqs:
            request = self.waiting[0]
            adapter = request.lora
            if adapter and lora is not None and adapter not in active and len(active) >= lora.config.max_loras:
                skipped.append(self.waiting.popleft())
                continue
            if not self._try_admit(request):
                break
            self.waiting.popleft()
            self.running.append(request)
            if adapter and lora is not None and adapter not in active:
                self._lora_seconds += lora.activate(adapter, active)
                active.add(adapter)
            chunk = min(request.context_len - request.num_computed, budget)
            work.append((request, chunk))
            budget -= chunk
        self.waiting.extendleft(reversed(skipped))
        # A request preempted after being picked this step must not run.
        return [(r, c) for r, c in work if r.admitted]

    def _finish(self, request: SimRequest, now: float, reason: str | None = None) -> None:
        if request.remote_decode and request.held_hashes == len(request.block_hashes):
            # The prefill half: its KV stays for the decode engine to read (release_transfer), or until the hold
            # expires, as vLLM's connector delays the free.
            count = request.held_hashes + request.uncached_blocks
            request.transfer_blocks = tuple(range(self._next_block_id, self._next_block_id + count))
            self._next_block_id += count
            # Simulated seconds on the wall clock; an engine without time (time_scale 0) holds them for real.
            self.held[request.transfer_blocks[0]] = (request, now + self.hold_seconds * (self.time_scale or 1.0))
        else:
            self._free(request)
        self.running.remove(request)
        request.finished = True
        request.finish_reason = reason or request.finish_reason_if_done
        self.stats.finished[request.finish_reason] = self.stats.finished.get(request.finish_reason, 0) + 1
        if self.on_finish:
            self.on_finish(request, now)

    def _emit(self, request: SimRequest, now: float) -> None:
        request.generated += 1
        self.stats.generation_tokens += 1
        if request.first_token_at is None:
            request.first_token_at = now
            if self.on_first_token:
                self.on_first_token(request, now)
        if request.stop and request.hit_stop():
            self._finish(request, now, "stop")
        elif request.generated >= request.max_tokens:
            self._finish(request, now)
        request._wakeup.set()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time()
        while True:
            if self.held:
                self.expire_transfers()
            if not self.running and not self.waiting:
                self._wakeup.clear()
                await self._wakeup.wait()
                deadline = loop.time()
            self._stepping = True  # the KV events from here to the step's end are its batch
            work = self._schedule()
            stats = self.stats
            stats.steps += 1
            stats.max_running = max(stats.max_running, len(self.running))
            stats.max_waiting = max(stats.max_waiting, len(self.waiting))
            if not work:
                self._end_step()
                # Cannot happen while max_model_len fits the cache (an empty
                # engine admits any valid request); do not spin if it does.
                log.warning("engine step scheduled nothing: %d running, %d waiting", len(self.running), len(self.waiting))
                self._wakeup.clear()
                try:
                    await asyncio.wait_for(self._wakeup.wait(), 0.1)
                except TimeoutError:
                    pass
                deadline = loop.time()
                continue
            decodes = context = prefill_tokens = 0
            for request, chunk in work:
                if request.decoding:
                    decodes += 1
                    context += request.context_len
                else:
                    prefill_tokens += chunk
            simulated = self.profile.step_seconds(decodes, context, prefill_tokens) + self._lora_seconds
            stats.step_seconds += simulated
            seconds = simulated * self.time_scale
            self._lora_seconds = 0.0
            # Sleep to an absolute deadline so the time this loop itself takes
            # is part of the step, not added to it.
            deadline = max(deadline + seconds, loop.time())
            await asyncio.sleep(deadline - loop.time())
            now = self._clock()
            for request, chunk in work:
                if not request.admitted:  # aborted during the step
                    continue
                request.num_computed += chunk
                if request.num_computed == request.context_len:
                    # The step sampled a token: the first one when it finished
                    # a prefill, the next one when decoding.
                    self._emit(request, now)
            self._end_step()

    def _end_step(self) -> None:
        self._stepping = False
        self._flush_kv()
