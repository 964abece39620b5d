"""API keys and per-key limits at the router (spec.router.auth, `--api-keys`): the keys read from the mounted Secret (or
a `tenant:key` file), reloaded when it changes and kept only as salted digests, and per tenant a token bucket of
requests and one of tokens a minute, charged an estimate at admission and settled to the usage. Design:
docs/security.md#clients-of-the-router.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import math
import os
import re
import secrets
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("tensorfleet.router.auth")

# What a Secret's data keys may be; a tenant name reaches /metrics as a label, so the Secret bounds the labels.
TENANT_PATTERN = re.compile(r"[-._a-zA-Z0-9]{1,253}")
MAX_KEY_BYTES = 4096
MAX_KEYS_FILE_BYTES = 4 * 1024 * 1024
BEARER = "bearer"

# Usage in an engine's answer: the last `"total_tokens": N` (a JSON key; the same characters inside a string
# value would have their quotes escaped).
_TOTAL_TOKENS = re.compile(rb'"total_tokens"\s*:\s*(\d+)')


class KeysError(Exception):
    """The keys path cannot be read."""


def read_keys(path: Path) -> tuple[dict[str, bytes], list[str]]:
    """The tenants and keys at PATH, and what was wrong, in words that never include a key (what is valid loads).
    KeysError if PATH cannot be read at all.

    PATH is a directory with one file per tenant, the file's name the tenant and its content the key (a Secret as
    Kubernetes mounts it; entries starting with a dot, the mount's own `..data` links, are not tenants), or a file of
    `tenant:key` lines (`#` comments and blank lines ignored). A key is its file or line stripped of surrounding
    whitespace, 1 to MAX_KEY_BYTES bytes; a key listed for two tenants names neither, so both are refused."""
    found: list[tuple[str, bytes, str]] = []  # tenant, key, where
    problems: list[str] = []
    try:
        if path.is_dir():
            with os.scandir(path) as entries:
                names = sorted(e.name for e in entries if not e.name.startswith("."))
            for name in names:
                entry = path / name
                if not entry.is_file():
                    continue
                with entry.open("rb") as handle:
                    found.append((name, handle.read(MAX_KEY_BYTES + 1).strip(), f"file {name}"))
        else:
            with path.open("rb") as handle:
                data = handle.read(MAX_KEYS_FILE_BYTES + 1)
            if len(data) > MAX_KEYS_FILE_BYTES:
                raise KeysError(f"{path} is larger than {MAX_KEYS_FILE_BYTES} bytes")
            for number, raw in enumerate(data.splitlines(), 1):
                text = raw.strip()
                if not text or text.startswith(b"#"):
                    continue
                name_bytes, colon, value = text.partition(b":")
                if not colon:
                    problems.append(f"line {number}: not `tenant:key`")
                    continue
                found.append((name_bytes.strip().decode("utf-8", "replace"), value.strip(), f"line {number}"))
    except OSError as exc:
        raise KeysError(f"cannot read {path}: {exc.strerror or exc}") from None
    keys: dict[str, bytes] = {}
    owners: dict[bytes, list[str]] = {}
    for tenant, key, where in found:
        if not TENANT_PATTERN.fullmatch(tenant):
            problems.append(f"{where}: tenant name {tenant[:80]!r} is not 1-253 of -._a-zA-Z0-9")
        elif tenant in keys:
            problems.append(f"{where}: tenant {tenant} is listed again; the first key counts")
        elif not key:
            problems.append(f"{where}: tenant {tenant} has an empty key")
        elif len(key) > MAX_KEY_BYTES:
            problems.append(f"{where}: tenant {tenant}'s key is longer than {MAX_KEY_BYTES} bytes")
        else:
            keys[tenant] = key
            owners.setdefault(key, []).append(tenant)
    for sharing in owners.values():
        if len(sharing) > 1:
            problems.append(f"tenants {', '.join(sharing)} have the same key: refused for all of them")
            for name in sharing:
                del keys[name]
    return keys, problems


def _fingerprint(path: Path) -> tuple[tuple[str, int, int, int], ...]:
    """What changes when PATH's content may have: its entries' names, inodes, sizes and mtimes (links
    followed). A Secret update replaces the mount's `..data` link, so it always changes this."""
    def one(name: str, target: Path) -> tuple[str, int, int, int]:
        st = target.stat()
        return name, st.st_ino, st.st_size, st.st_mtime_ns

    top = path.stat()
    if not stat.S_ISDIR(top.st_mode):
        return (one("", path),)
    with os.scandir(path) as entries:
        names = sorted(e.name for e in entries)
    out = [("", top.st_ino, top.st_size, top.st_mtime_ns)]
    for name in names:
        try:
            out.append(one(name, path / name))
        except OSError:
            out.append((name, 0, 0, 0))  # a dangling link, or gone meanwhile
    return tuple(out)


class KeyRing:
    """The API keys in force, as salted digests, and the tenant each belongs to."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._salt = secrets.token_bytes(32)
        self._entries: tuple[tuple[bytes, str], ...] = ()
        self._fingerprint: tuple[tuple[str, int, int, int], ...] | None = None
        self._failing = False  # the last refresh could not read the path (said once, not every interval)
        self.tenants: frozenset[str] = frozenset()

    def _digest(self, key: bytes) -> bytes:
        return hmac.new(self._salt, key, hashlib.sha256).digest()

    def load(self) -> None:
        """Read the keys now (KeysError if the path cannot be read: the keys in force stay)."""
        try:
            fingerprint = _fingerprint(self.path)
        except OSError as exc:
            raise KeysError(f"cannot read {self.path}: {exc.strerror or exc}") from None
        keys, problems = read_keys(self.path)
        for problem in problems:
            log.warning("API keys %s: %s", self.path, problem)
        self._entries = tuple((self._digest(key), tenant) for tenant, key in sorted(keys.items()))
        self._fingerprint = fingerprint
        self.tenants = frozenset(keys)
        if not keys:
            log.warning("API keys %s: no valid key; every request is refused (401)", self.path)

    def refresh(self) -> bool:
        """Read the keys again if the path changed; whether they were. A failure is logged (once while it
        lasts); the keys in force stay."""
        try:
            unchanged = _fingerprint(self.path) == self._fingerprint
            self._failing = False
            if unchanged:
                return False
            before = self.tenants
            self.load()
        except (KeysError, OSError) as exc:
            if not self._failing:
                log.error("API keys: %s; the keys already loaded stay in force", exc)
            self._failing = True
            return False
        log.info("API keys reloaded from %s: %d tenants (%d added, %d removed)", self.path, len(self.tenants),
                 len(self.tenants - before), len(before - self.tenants))
        return True

    def tenant(self, authorization: str | None) -> str | None:
        """The tenant whose key an `Authorization: Bearer KEY` header carries; None for none."""
        if not authorization:
            return None
        scheme, _, key = authorization.strip().partition(" ")
        key = key.strip()
        if scheme.lower() != BEARER or not key:
            return None
        digest = self._digest(key.encode("utf-8", "surrogateescape"))
        matched: str | None = None
        for stored, tenant in self._entries:  # every one, matched or not: the time says nothing
            if hmac.compare_digest(stored, digest):
                matched = tenant
        return matched


def open_keys(path: str | None) -> KeyRing | None:
    """The keys at PATH, read now (KeysError if PATH cannot be read, so a process stops at start); None without."""
    if not path:
        return None
    keys = KeyRing(path)
    keys.load()
    return keys


class TokenBucket:
    """PER_MINUTE units a minute, refilled evenly, holding at most one minute's worth; it may go below zero."""

    def __init__(self, per_minute: int, now: float) -> None:
        self.capacity = float(per_minute)
        self.rate = per_minute / 60.0
        self.level = self.capacity
        self.updated = now

    def _refill(self, now: float) -> None:
        if now > self.updated:
            self.level = min(self.capacity, self.level + (now - self.updated) * self.rate)
            self.updated = now

    def wait(self, amount: float, now: float) -> float:
        """Seconds until the bucket holds AMOUNT (a full bucket for more than it holds, so every request can pass
        eventually); 0 if it does."""
        self._refill(now)
        need = min(amount, self.capacity)
        return 0.0 if self.level >= need else (need - self.level) / self.rate

    def take(self, amount: float, now: float) -> None:
        self._refill(now)
        self.level -= amount

    def give(self, amount: float, now: float) -> None:
        self._refill(now)
        self.level = min(self.capacity, self.level + amount)


@dataclass(frozen=True)
class Refusal:
    """Over a limit: which one (`requests` or `tokens`), what to tell the client, and when to come back."""

    limit: str
    message: str
    retry_after: int


@dataclass
class _Buckets:
    requests: TokenBucket | None
    tokens: TokenBucket | None


class Limits:
    """Each tenant's buckets (created on first use), on CLOCK (a test may replace it)."""

    def __init__(self, requests_per_minute: int | None, tokens_per_minute: int | None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.requests_per_minute = requests_per_minute
        self.tokens_per_minute = tokens_per_minute
        self.clock = clock
        self._tenants: dict[str, _Buckets] = {}

    @property
    def counts_tokens(self) -> bool:
        return self.tokens_per_minute is not None

    def _buckets(self, tenant: str) -> _Buckets:
        buckets = self._tenants.get(tenant)
        if buckets is None:
            now = self.clock()
            buckets = self._tenants[tenant] = _Buckets(
                TokenBucket(self.requests_per_minute, now) if self.requests_per_minute else None,
                TokenBucket(self.tokens_per_minute, now) if self.tokens_per_minute else None)
        return buckets

    def admit_request(self, tenant: str) -> Refusal | None:
        """Take one request from TENANT's bucket, or say why not."""
        bucket = self._buckets(tenant).requests
        if bucket is None:
            return None
        now = self.clock()
        wait = bucket.wait(1, now)
        if wait:
            retry = _seconds(wait)
            return Refusal("requests", f"rate limit reached: this API key may send {self.requests_per_minute} "
                                       f"requests per minute; retry in {retry}s", retry)
        bucket.take(1, now)
        return None

    def admit_tokens(self, tenant: str, estimate: int) -> Refusal | None:
        """Charge ESTIMATE tokens to TENANT, or say why not (nothing charged)."""
        bucket = self._buckets(tenant).tokens
        if bucket is None:
            return None
        now = self.clock()
        wait = bucket.wait(estimate, now)
        if wait:
            retry = _seconds(wait)
            return Refusal("tokens", f"rate limit reached: this API key may use {self.tokens_per_minute} tokens "
                                     f"per minute, and this request may use up to {estimate} (its prompt, estimated, "
                                     f"plus the most it may generate); retry in {retry}s", retry)
        bucket.take(estimate, now)
        return None

    def settle(self, tenant: str, charged: int, used: int) -> None:
        """The request charged CHARGED tokens and used USED: give back the difference, or take it. (A tenant
        removed from the keys meanwhile is not brought back.)"""
        buckets = self._tenants.get(tenant)
        bucket = buckets.tokens if buckets is not None else None
        if bucket is None or used == charged:
            return
        now = self.clock()
        if used < charged:
            bucket.give(charged - used, now)
        else:
            bucket.take(used - charged, now)

    def tokens_left(self, tenant: str) -> float | None:
        """What TENANT's token bucket holds now (None: tokens are not limited)."""
        bucket = self._buckets(tenant).tokens
        if bucket is None:
            return None
        bucket.wait(0, self.clock())  # refills
        return bucket.level

    def retain(self, tenants: frozenset[str]) -> None:
        """Forget the buckets of tenants that are gone."""
        for tenant in [t for t in self._tenants if t not in tenants]:
            del self._tenants[tenant]


def _seconds(wait: float) -> int:
    return max(1, math.ceil(wait))


@dataclass
class UsageMeter:
    """Tokens one request used, from its answer: the engine's `usage` of a whole answer, or a stream's counts as
    the router tracked them (router/resume.StreamState: the engines' own, else estimated from the text);
    `answered` once an engine answered without an error."""

    prompt: int
    total: int | None = None
    answered: bool = False

    def answer(self, status: int, payload: bytes) -> None:
        """A whole answer."""
        if status < 400:
            self.answered = True
            self.total = _usage_total(payload)

    def stream(self, prompt_tokens: int | None, completion_tokens: int) -> None:
        """A stream, once it ended: its prompt as an engine counted it (None: none did, the estimate stands for
        it) and the completion tokens the client got."""
        self.answered = True
        self.total = (self.prompt if prompt_tokens is None else prompt_tokens) + completion_tokens

    def used(self) -> int | None:
        """Tokens to charge; None when an engine answered but said nothing of them (the estimate stands); 0 when
        none answered without an error."""
        if self.total is not None:
            return self.total
        return None if self.answered else 0


def _usage_total(payload: bytes) -> int | None:
    start = payload.rfind(b'"usage"')
    if start < 0:
        return None
    found = _TOTAL_TOKENS.search(payload, start)
    return int(found.group(1)) if found else None
