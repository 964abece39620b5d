"""A chat workload with heterogeneous lengths and multi-turn sessions sharing prefixes.

Each session belongs to one of a few tenants whose system prompt (~400 tokens)
every session of that tenant shares; it carries its own document (0-2,500
tokens, uniform) and asks 1-6 questions (10-150 tokens) in turn, each prompt
re-sending the whole conversation so far, as chat clients do. Answer lengths
are log-normal (median 100, 8-600 tokens). Sessions arrive as a Poisson
process; inside a session each turn waits for the previous answer plus an
exponential think time. Everything is drawn from one seed, so every strategy
sees the same sessions; the simulators answer a given prompt identically on
any engine, so conversations are identical too.

Words are four random letters, one token each under the simulator's
tokenizer, so lengths in tokens are what the generator asked for.

`shared=False` makes the prefix-free variant: every session has a system prompt
of its own and one turn, so no prompt shares a prefix with another. Those are
the default sizes; a `Shape` gives others (bench_goodput's `--shape`), to see
how routing holds up on a workload it was not tuned on.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import random
import string
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from common import StreamResult, stream_chat

TENANTS = 4
SYSTEM_TOKENS = 400
DOC_TOKENS = (0, 2500)
TURNS = (1, 6)
QUESTION_TOKENS = (10, 150)
ANSWER_MEDIAN, ANSWER_SIGMA, ANSWER_RANGE = 100, 0.8, (8, 600)
THINK_MEAN_SECONDS = 2.0  # simulated


@dataclass(frozen=True)
class Shape:
    """The workload's sizes (the defaults above); `parse` reads one from a command line's KEY=VALUE list."""

    tenants: int = TENANTS
    system_tokens: int = SYSTEM_TOKENS
    doc_tokens: tuple[int, int] = DOC_TOKENS
    turns: tuple[int, int] = TURNS
    question_tokens: tuple[int, int] = QUESTION_TOKENS
    answer_median: int = ANSWER_MEDIAN
    answer_range: tuple[int, int] = ANSWER_RANGE
    think_seconds: float = THINK_MEAN_SECONDS

    @property
    def mean_turns(self) -> float:
        return (self.turns[0] + self.turns[1]) / 2

    @classmethod
    def parse(cls, text: str) -> Shape:
        """TEXT: comma-separated KEY=VALUE, a range as LO-HI (e.g. `tenants=8,doc_tokens=0-8000,turns=2-8`).
        Raises ValueError naming the key."""
        defaults = {f.name: getattr(DEFAULT_SHAPE, f.name) for f in dataclasses.fields(cls)}
        values: dict[str, Any] = {}
        for item in filter(None, (x.strip() for x in text.split(","))):
            key, _, value = item.partition("=")
            if key not in defaults:
                raise ValueError(f"unknown workload key {key!r}; known: {', '.join(defaults)}")
            ranged = isinstance(defaults[key], tuple)   # a key reads as its default's kind: a range or a number
            try:
                if ranged:
                    lo, _, hi = value.partition("-")
                    values[key] = (int(lo), int(hi or lo))
                    if not 0 <= values[key][0] <= values[key][1]:
                        raise ValueError
                else:
                    values[key] = type(defaults[key])(value)
                    if values[key] < 0:
                        raise ValueError
            except ValueError:
                raise ValueError(f"workload key {key}={value!r}: expected "
                                 f"{'LO-HI, whole numbers, LO <= HI' if ranged else 'a number >= 0'}") from None
        shape = cls(**values)
        if shape.tenants < 1 or shape.turns[0] < 1:
            raise ValueError("workload: tenants and turns need at least 1")
        return shape

    def describe(self) -> str:
        """The keys that differ from the defaults, as `parse` reads them ('' for the default shape)."""
        return ",".join(f"{f.name}={'-'.join(map(str, v)) if isinstance(v, tuple) else v}"
                        for f in dataclasses.fields(self) if (v := getattr(self, f.name)) != getattr(DEFAULT_SHAPE, f.name))


DEFAULT_SHAPE = Shape()


def random_words(rng: random.Random, n: int) -> str:
    return " ".join("".join(rng.choices(string.ascii_lowercase, k=4)) for _ in range(n))


@dataclass
class Turn:
    question: str
    max_tokens: int


@dataclass
class SessionPlan:
    key: str
    system: str
    document: str
    turns: list[Turn]
    think: list[float]


@dataclass
class Record:
    session: str
    turn: int
    result: StreamResult
    messages: list[dict[str, Any]] = field(default_factory=list)   # what the request sent


def ok(r: Record) -> bool:
    """Answered: a 200 whose stream carried a first token and no error."""
    return r.result.status == 200 and not r.result.error and r.result.ttft is not None


@dataclass
class Workload:
    seed: int
    shared: bool = True
    shape: Shape = DEFAULT_SHAPE
    systems: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        rng, shape = random.Random(self.seed), self.shape
        self.systems = [f"You are assistant {t} of tenant {t}. " + random_words(rng, shape.system_tokens)
                        for t in range(shape.tenants)]
        self._rng = random.Random(self.seed + 1)
        self._count = 0

    def session(self) -> SessionPlan:
        rng, shape = self._rng, self.shape
        self._count += 1
        answer_lo, answer_hi = shape.answer_range
        turns = [Turn(random_words(rng, rng.randint(*shape.question_tokens)) + "?",
                      int(min(max(rng.lognormvariate(0, ANSWER_SIGMA) * shape.answer_median, answer_lo), answer_hi)))
                 for _ in range(rng.randint(*shape.turns) if self.shared else 1)]
        system = (self.systems[rng.randrange(shape.tenants)] if self.shared
                  else f"You are assistant {self._count}. " + random_words(rng, shape.system_tokens))
        return SessionPlan(
            key=f"session-{self.seed}-{self._count}",
            system=system,
            document=random_words(rng, rng.randint(*shape.doc_tokens)),
            turns=turns,
            think=[rng.expovariate(1 / shape.think_seconds) if shape.think_seconds else 0.0 for _ in turns],
        )


async def run_session(http: aiohttp.ClientSession, url: str | Sequence[str], plan: SessionPlan,
                      records: list[Record], time_scale: float, stop_at: float) -> None:
    """The session's turns in order. Several URLs (router replicas behind a client-side split): each turn goes to
    one drawn from the session's key and turn, so every run of the same workload splits alike."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": plan.system}]
    for index, turn in enumerate(plan.turns):
        if time.perf_counter() >= stop_at:
            return
        content = (f"Document:\n{plan.document}\n\n" if index == 0 and plan.document else "") + turn.question
        messages.append({"role": "user", "content": content})
        target = url if isinstance(url, str) else random.Random(f"{plan.key}/{index}").choice(url)
        result = await stream_chat(http, target, messages, turn.max_tokens, headers={"x-session-id": plan.key})
        records.append(Record(plan.key, index, result, list(messages)))
        if result.status != 200 or result.error:
            return
        messages.append({"role": "assistant", "content": result.text})
        await asyncio.sleep(plan.think[index] * time_scale)


async def open_loop(url: str | Sequence[str], workload: Workload, sessions_per_second: float, seconds: float, time_scale: float,
                    drain_seconds: float = 120.0, sustain: bool = False) -> tuple[list[Record], float]:
    """Start sessions at Poisson times for `seconds`; stop new turns then; wait (at most `drain_seconds`).

    SUSTAIN: sessions keep arriving at the same rate after `seconds` until every turn started before it has its
    answer, so those turns are served under the load they were sent into rather than by a fleet emptying after the
    last arrival (an engine with no new prompts decodes every step at full speed, and a backlog served then would
    count as good inter-token times that the load never gives). Their records come back too, sent after `seconds`;
    the ones still running at the end are cancelled."""
    records: list[Record] = []
    rng = random.Random(workload.seed + 2)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as http:
        start = time.perf_counter()
        stop_at = start + seconds
        tasks: list[asyncio.Task[None]] = []
        extra: list[asyncio.Task[None]] = []
        next_at = start
        while True:
            next_at += rng.expovariate(sessions_per_second)
            if next_at >= stop_at:
                break
            await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
            tasks.append(asyncio.create_task(run_session(http, url, workload.session(), records, time_scale, stop_at)))
        waiting = asyncio.ensure_future(asyncio.wait(tasks, timeout=drain_seconds)) if tasks else None
        if sustain and waiting is not None:
            while not waiting.done():
                await asyncio.wait([waiting], timeout=max(0.0, next_at - time.perf_counter()))
                if waiting.done():
                    break
                extra.append(asyncio.create_task(run_session(http, url, workload.session(), records, time_scale,
                                                             math.inf)))
                next_at += rng.expovariate(sessions_per_second)
        _done, pending = await waiting if waiting is not None else (set(), set())
        for task in (*pending, *extra):
            task.cancel()
        await asyncio.gather(*pending, *extra, return_exceptions=True)
    return records, start


async def closed_loop(url: str, workload: Workload, concurrency: int, seconds: float,
                      time_scale: float) -> tuple[list[Record], float]:
    """`concurrency` sessions back to back, no think time: saturates the fleet."""
    records: list[Record] = []
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as http:
        start = time.perf_counter()
        stop_at = start + seconds

        async def worker() -> None:
            while time.perf_counter() < stop_at:
                plan = workload.session()
                plan.think = [0.0] * len(plan.turns)
                await run_session(http, url, plan, records, time_scale, stop_at)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return records, start
