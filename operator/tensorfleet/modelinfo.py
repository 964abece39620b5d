"""Model facts from the model itself: its config.json (and hf_quant_config.json) from the Hugging Face Hub, the
local Hugging Face cache, a model directory or a file. The I/O half of model facts (`catalog/modelconfig.py` is the
pure half): the planner never calls it; its caller does and hands the facts to `make_plan(spec, facts)`. Design:
docs/planner.md#where-the-facts-come-from."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tensorfleet.catalog.facts import ModelFacts, ModelSource
from tensorfleet.catalog.modelconfig import ModelConfigError, parse_model_config

CONFIG_FILE = "config.json"
QUANT_CONFIG_FILE = "hf_quant_config.json"
MAX_CONFIG_BYTES = 4 * 1024 * 1024     # a config.json is a few KiB; refuse anything absurd
DEFAULT_TTL_SECONDS = 3600.0
ERROR_TTL_SECONDS = 60.0
DEFAULT_TIMEOUT_SECONDS = 10.0
_TRUE = {"1", "true", "yes", "on"}
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
# A Hugging Face repository id: `name` or `owner/name`, no path tricks.
_REPO_ID = re.compile(r"^(?:[A-Za-z0-9][\w.-]{0,95}/)?[A-Za-z0-9][\w.-]{0,95}$")


class ModelInfoError(Exception):
    """No facts could be read for a model; str() says why, for an event, a condition or stderr."""


@dataclass(frozen=True)
class _Entry:
    at: float                  # time.monotonic() when it was read
    facts: ModelFacts | None
    error: str | None


_cache: dict[tuple[object, ...], _Entry] = {}
_lock = threading.Lock()


def clear_cache() -> None:
    """Forget every answer kept in process (tests; a changed token or endpoint needs no clearing)."""
    with _lock:
        _cache.clear()


def hub_offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE), read now rather than at import."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.strip().lower() in _TRUE


def hub_endpoint() -> str | None:
    """HF_ENDPOINT, read now, or None for huggingface_hub's default."""
    value = os.environ.get("HF_ENDPOINT", "").strip().rstrip("/")
    return value or None


def is_repo_id(name: str) -> bool:
    """Whether NAME reads as a Hugging Face repository id (`owner/name`), not a local path."""
    return not name.startswith(("/", "./", "../", "~")) and bool(_REPO_ID.match(name))


def resolve_model(
    name: str,
    revision: str | None = None,
    *,
    token: str | None = None,
    cache_dir: str | Path | None = None,
    offline: bool | None = None,
    endpoint: str | None = None,
    timeout: float = DEFAULT_TIMEOUT_SECONDS,
    ttl: float = DEFAULT_TTL_SECONDS,
    error_ttl: float = ERROR_TTL_SECONDS,
) -> ModelFacts:
    """The facts of model NAME (a Hugging Face id or a local directory) at REVISION. Raises ModelInfoError, saying
    why, when none can be read (the caller then falls back to the catalog).

    A local directory holding config.json is read there (source `cache`). Online (OFFLINE None: HF_HUB_OFFLINE
    decides), one HEAD of ENDPOINT's (HF_ENDPOINT's) `{name}/resolve/{revision}/config.json` through
    huggingface_hub with TOKEN (None: HF_TOKEN or the stored login), then config.json and, when the repository has
    one, hf_quant_config.json, downloaded into the Hugging Face cache (CACHE_DIR, default HF_HUB_CACHE): source
    `hub`, the revision the commit the Hub named. The Hub unreachable, or offline: the files already in that cache
    (`cache`). Answers, errors too, are kept in process keyed by everything that changes them (the token by digest
    only) for TTL seconds (errors ERROR_TTL): a reconcile storm asks the Hub once, a moved branch is seen within
    TTL. Blocking and thread-safe; asyncio callers use resolve_model_async. Without huggingface_hub (the `hub`
    extra) only local directories are read.
    """
    offline = hub_offline() if offline is None else offline
    endpoint = (endpoint or hub_endpoint() or "").rstrip("/") or None
    digest = hashlib.sha256(token.encode()).hexdigest()[:16] if token else None
    key = (name, revision, endpoint, str(cache_dir) if cache_dir else None, offline, digest)
    with _lock:
        entry = _cache.get(key)
    if entry is not None:
        age = time.monotonic() - entry.at
        if entry.facts is not None and age < ttl:
            return entry.facts
        if entry.facts is None and age < error_ttl:
            raise ModelInfoError(entry.error or "no facts")
    try:
        facts = _resolve(name, revision, token=token, cache_dir=cache_dir, offline=offline, endpoint=endpoint,
                         timeout=timeout)
    except ModelInfoError as exc:
        with _lock:
            _cache[key] = _Entry(time.monotonic(), None, str(exc))
        raise
    with _lock:
        _cache[key] = _Entry(time.monotonic(), facts, None)
    return facts


async def resolve_model_async(name: str, revision: str | None = None, **options: Any) -> ModelFacts:
    """resolve_model in a worker thread, for asyncio callers (the operator's reconcile)."""
    return await asyncio.to_thread(resolve_model, name, revision, **options)


def read_model_config(path: str | Path, name: str | None = None, source: ModelSource = "file") -> ModelFacts:
    """Facts from a config.json FILE, or a directory holding one (and hf_quant_config.json beside it)."""
    where = Path(path).expanduser()
    config_path = where / CONFIG_FILE if where.is_dir() else where
    if not config_path.is_file():
        raise ModelInfoError(f"{path}: no such file" if not where.is_dir() else f"{path}: no {CONFIG_FILE} in it")
    quant_path = config_path.parent / QUANT_CONFIG_FILE
    return _parse(
        name or (str(where) if where.is_dir() else str(config_path.parent)),
        _load_json(config_path),
        _load_json(quant_path) if quant_path.is_file() else None,
        source=source,
        revision=None,
        label=str(config_path),
    )


# --- internals -----------------------------------------------------------------------------


def _resolve(name: str, revision: str | None, *, token: str | None, cache_dir: str | Path | None, offline: bool,
             endpoint: str | None, timeout: float) -> ModelFacts:
    local = Path(name).expanduser()
    if (name.startswith(("/", "./", "../", "~")) or not _REPO_ID.match(name)) and local.is_dir():
        return read_model_config(local, name, source="cache")
    if not _REPO_ID.match(name):
        raise ModelInfoError(f"{name!r} is neither a Hugging Face repository id nor a local model directory")
    try:
        import huggingface_hub  # noqa: F401 - optional dependency, checked here
    except ImportError:
        raise ModelInfoError("huggingface_hub is not installed (pip install 'tensorfleet[hub]')") from None

    why_not_hub = "offline (HF_HUB_OFFLINE)"
    if not offline:
        try:
            return _from_hub(name, revision, token=token, cache_dir=cache_dir, endpoint=endpoint, timeout=timeout)
        except _Unreachable as exc:
            why_not_hub = str(exc)
    cached = _from_cache(name, revision, cache_dir)
    if cached is not None:
        return cached
    raise ModelInfoError(f"{name}: {CONFIG_FILE} not read: {why_not_hub}, and not in the local Hugging Face cache")


def _timed_out(exc: BaseException) -> bool:
    """Whether EXC, or what it wraps, is a timeout (the builtin's, or the HTTP client's own *Timeout* classes)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, TimeoutError) or "Timeout" in type(current).__name__:
            return True
        current = current.__cause__ or current.__context__
    return False


class _Unreachable(Exception):
    """The Hub could not be asked (network, offline mode, server error): the cache may still answer."""


def _from_hub(name: str, revision: str | None, *, token: str | None, cache_dir: str | Path | None,
              endpoint: str | None, timeout: float) -> ModelFacts:
    from huggingface_hub import get_hf_file_metadata, hf_hub_download, hf_hub_url
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    wanted = revision or "main"
    url = hf_hub_url(name, CONFIG_FILE, revision=wanted, endpoint=endpoint)
    try:
        metadata = get_hf_file_metadata(url, token=token, timeout=timeout)
    except GatedRepoError:
        raise ModelInfoError(f"{name} is gated: accept its licence on the Hub and give a token "
                             "(spec.hfTokenSecretRef, HF_TOKEN)") from None
    except RepositoryNotFoundError:
        raise ModelInfoError(f"{name}: no such repository on {endpoint or 'the Hugging Face Hub'}, or it is private "
                             "and no token with access was given") from None
    except RevisionNotFoundError:
        raise ModelInfoError(f"{name}: no revision {wanted!r}") from None
    except (EntryNotFoundError, LocalEntryNotFoundError):
        raise ModelInfoError(f"{name}@{wanted} has no {CONFIG_FILE}") from None
    except OfflineModeIsEnabled:
        raise _Unreachable("offline (HF_HUB_OFFLINE)") from None
    except HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else None
        if status is not None and status < 500 and status != 429:
            raise ModelInfoError(f"{name}: the Hub answered {status} for {CONFIG_FILE}") from None
        raise _Unreachable(f"the Hub answered {status}") from None
    except Exception as exc:  # noqa: BLE001 - connection, DNS, TLS, timeout: whatever the HTTP client raises
        if _timed_out(exc):
            raise _Unreachable(f"the Hub did not answer within {timeout:g} s") from None
        raise _Unreachable(f"the Hub could not be reached ({type(exc).__name__}: {exc})") from None
    commit = metadata.commit_hash if metadata.commit_hash and _COMMIT.match(metadata.commit_hash) else wanted

    def fetch(filename: str) -> dict[str, Any] | None:
        try:
            # By the revision asked for (not the commit), so the cache records it for offline reads.
            path = hf_hub_download(name, filename, revision=wanted, cache_dir=cache_dir, token=token,
                                   endpoint=endpoint, etag_timeout=timeout)
        except EntryNotFoundError:
            return None
        except Exception as exc:  # noqa: BLE001 - the HEAD just succeeded; whatever fails now is the transfer
            raise ModelInfoError(f"{name}: downloading {filename} failed ({type(exc).__name__}: {exc})") from None
        return _load_json(Path(str(path)))

    config = fetch(CONFIG_FILE)
    if config is None:
        raise ModelInfoError(f"{name}@{wanted} has no {CONFIG_FILE}")
    quant = fetch(QUANT_CONFIG_FILE) if "quantization_config" not in config else None
    return _parse(name, config, quant, source="hub", revision=commit if _COMMIT.match(commit) else None,
                  label=f"{name}/{CONFIG_FILE}")


def _from_cache(name: str, revision: str | None, cache_dir: str | Path | None) -> ModelFacts | None:
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(name, CONFIG_FILE, cache_dir=cache_dir, revision=revision)
    if not isinstance(found, str):
        return None
    config_path = Path(found)
    quant = try_to_load_from_cache(name, QUANT_CONFIG_FILE, cache_dir=cache_dir, revision=revision)
    commit = config_path.parent.name
    return _parse(
        name, _load_json(config_path), _load_json(Path(quant)) if isinstance(quant, str) else None,
        source="cache", revision=commit if _COMMIT.match(commit) else None, label=str(config_path),
    )


def _load_json(path: Path) -> dict[str, Any]:
    try:
        if path.stat().st_size > MAX_CONFIG_BYTES:
            raise ModelInfoError(f"{path}: larger than {MAX_CONFIG_BYTES // 1024 // 1024} MiB; not a config.json")
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelInfoError(f"{path}: cannot be read ({exc})") from None
    except json.JSONDecodeError as exc:
        raise ModelInfoError(f"{path}: not valid JSON (line {exc.lineno}: {exc.msg})") from None
    if not isinstance(data, dict):
        raise ModelInfoError(f"{path}: not a JSON object")
    return data


def _parse(name: str, config: dict[str, Any], quant: dict[str, Any] | None, *, source: ModelSource,
           revision: str | None, label: str) -> ModelFacts:
    try:
        return parse_model_config(config, name=name, source=source, hf_quant_config=quant, revision=revision)
    except ModelConfigError as exc:
        raise ModelInfoError(f"{label}: {exc}") from None
