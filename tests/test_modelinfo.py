"""Reading a model's config.json through huggingface_hub's real code path, from a Hub stand-in on loopback.

tests/hub_server.py serves tests/data/models as the Hub does (`/{repo}/resolve/{revision}/{file}`,
X-Repo-Commit, ETag, the Hub's error codes); HF_ENDPOINT points huggingface_hub at it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import huggingface_hub.constants
import pytest
import yaml
from conftest import ROOT, isvc_doc
from hub_server import FakeHub, commit_of, fake_hub
from test_modelconfig import DATA, L70_FIXED, L70_LINEAR, facts

from tensorfleet import modelinfo
from tensorfleet.cli import main
from tensorfleet.modelinfo import ModelInfoError, read_model_config, resolve_model

GATED = "meta-llama/Llama-3.1-8B-Instruct"
TOKEN = "hf_test_token"


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
    """The stand-in Hub, online: conftest turns the suite offline, and huggingface_hub reads that at import."""
    modelinfo.clear_cache()
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    with fake_hub(gated={GATED: TOKEN}) as served:
        monkeypatch.setenv("HF_ENDPOINT", served.url)
        yield served
    modelinfo.clear_cache()


@pytest.fixture
def cache(tmp_path: Path) -> Path:
    return tmp_path / "hf-cache"


def repos() -> list[str]:
    return sorted(str(p.parent.relative_to(DATA)) for p in DATA.glob("*/*/config.json"))


@pytest.mark.parametrize("repo", repos())
def test_every_stored_config_reads_from_the_hub_as_from_the_file(hub: FakeHub, cache: Path, repo: str) -> None:
    got = resolve_model(repo, token=TOKEN, cache_dir=cache)
    assert (got.source, got.revision) == ("hub", commit_of(repo))
    direct = facts(repo)
    assert got.parameters == direct.parameters and got.weight_bytes() == direct.weight_bytes()
    assert got.weight_format == direct.weight_format and got.arch == direct.arch
    # huggingface_hub itself put the file in the cache, under the commit the Hub named.
    assert (cache / f"models--{repo.replace('/', '--')}" / "snapshots" / commit_of(repo) / "config.json").is_file()


def test_the_hub_is_asked_by_head_then_get_and_optional_files_may_be_missing(hub: FakeHub, cache: Path) -> None:
    resolve_model("Qwen/Qwen3-8B", cache_dir=cache)
    asked = [(method, path) for method, path, _ in hub.requests]
    assert ("HEAD", "/Qwen/Qwen3-8B/resolve/main/config.json") in asked
    assert ("GET", "/Qwen/Qwen3-8B/resolve/main/config.json") in asked
    # No hf_quant_config.json in the repository: a 404 EntryNotFound, and no error.
    assert ("HEAD", "/Qwen/Qwen3-8B/resolve/main/hf_quant_config.json") in asked


def test_modelopt_hf_quant_config_is_read(hub: FakeHub, cache: Path) -> None:
    got = resolve_model("nvidia/Llama-3.1-8B-Instruct-FP8", cache_dir=cache)
    assert got.weight_format.name == "fp8" and "hf_quant_config.json" in got.weight_format.detail
    assert ("GET", "/nvidia/Llama-3.1-8B-Instruct-FP8/resolve/main/hf_quant_config.json") in \
        [(m, p) for m, p, _ in hub.requests]


def test_gated_repository_needs_the_token_and_gets_it(hub: FakeHub, cache: Path) -> None:
    with pytest.raises(ModelInfoError, match="is gated"):
        resolve_model(GATED, cache_dir=cache)
    got = resolve_model(GATED, token=TOKEN, cache_dir=cache)
    assert got.source == "hub"
    assert all(auth == f"Bearer {TOKEN}" for _, path, auth in hub.requests[1:]), hub.requests


def test_huggingface_hubs_own_token_is_used_when_none_is_given(hub: FakeHub, cache: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    assert resolve_model(GATED, cache_dir=cache).source == "hub"


@pytest.mark.parametrize(("name", "revision", "phrase"), [
    ("acme/no-such-model", None, "no such repository"),
    ("Qwen/Qwen3-8B", "v9.9", "no revision 'v9.9'"),
    ("../etc/passwd", None, "neither a Hugging Face repository id nor a local model directory"),
])
def test_what_cannot_be_read_says_why(hub: FakeHub, cache: Path, name: str, revision: str | None, phrase: str) -> None:
    with pytest.raises(ModelInfoError) as err:
        resolve_model(name, revision, cache_dir=cache)
    assert phrase in str(err.value)


def test_a_revision_is_read_at_its_commit(hub: FakeHub, cache: Path) -> None:
    commit = commit_of("Qwen/Qwen3-8B")
    got = resolve_model("Qwen/Qwen3-8B", commit, cache_dir=cache)
    assert got.revision == commit
    assert ("HEAD", f"/Qwen/Qwen3-8B/resolve/{commit}/config.json") in [(m, p) for m, p, _ in hub.requests]


def test_offline_reads_the_cache_the_hub_filled(hub: FakeHub, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    online = resolve_model("Qwen/Qwen3-30B-A3B", cache_dir=cache)
    asked = len(hub.requests)
    modelinfo.clear_cache()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    offline = resolve_model("Qwen/Qwen3-30B-A3B", cache_dir=cache)
    assert (offline.source, offline.revision) == ("cache", online.revision)
    assert offline.weight_bytes() == online.weight_bytes()
    assert len(hub.requests) == asked, "offline asked the Hub"
    with pytest.raises(ModelInfoError, match="offline"):
        resolve_model("Qwen/Qwen3-8B", cache_dir=cache)


def test_an_unreachable_hub_falls_back_to_the_cache(hub: FakeHub, cache: Path) -> None:
    resolve_model("mistralai/Mistral-7B-Instruct-v0.3", cache_dir=cache)
    modelinfo.clear_cache()
    hub.fail_with = 503
    assert resolve_model("mistralai/Mistral-7B-Instruct-v0.3", cache_dir=cache).source == "cache"
    with pytest.raises(ModelInfoError, match="503"):
        resolve_model("microsoft/phi-4", cache_dir=cache)
    modelinfo.clear_cache()
    refused = resolve_model("mistralai/Mistral-7B-Instruct-v0.3", cache_dir=cache, endpoint="http://127.0.0.1:9")
    assert refused.source == "cache"


def test_answers_are_kept_in_process_for_their_ttl(hub: FakeHub, cache: Path) -> None:
    first = resolve_model("Qwen/Qwen2.5-7B-Instruct", cache_dir=cache)
    asked = len(hub.requests)
    assert resolve_model("Qwen/Qwen2.5-7B-Instruct", cache_dir=cache) is first
    assert len(hub.requests) == asked
    resolve_model("Qwen/Qwen2.5-7B-Instruct", cache_dir=cache, ttl=0)    # expired at once: asks again
    resolve_model("Qwen/Qwen2.5-7B-Instruct", cache_dir=cache, ttl=0)
    assert len(hub.requests) > asked
    # Errors are kept too (a reconcile storm must not hammer the Hub), for their own TTL.
    with pytest.raises(ModelInfoError):
        resolve_model("acme/missing", cache_dir=cache)
    asked = len(hub.requests)
    with pytest.raises(ModelInfoError):
        resolve_model("acme/missing", cache_dir=cache)
    assert len(hub.requests) == asked
    # Another token is another answer: a gated model opens once the token comes.
    with pytest.raises(ModelInfoError):
        resolve_model(GATED, cache_dir=cache)
    assert resolve_model(GATED, cache_dir=cache, token=TOKEN).source == "hub"


@pytest.mark.asyncio
async def test_async_callers_resolve_in_a_thread(hub: FakeHub, cache: Path) -> None:
    got = await modelinfo.resolve_model_async("openai/gpt-oss-120b", cache_dir=cache)
    assert got.weight_format.name == "mxfp4"


def test_a_local_model_directory_and_a_file(tmp_path: Path) -> None:
    folder = tmp_path / "models" / "llama-70b-w4"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text((DATA / "RedHatAI/Meta-Llama-3.1-70B-Instruct-quantized.w4a16/config.json").read_text())
    modelinfo.clear_cache()
    got = resolve_model(str(folder), offline=True)
    assert got.source == "cache" and got.weight_format.name == "int4"
    assert read_model_config(folder / "config.json").source == "file"
    assert read_model_config(DATA / "nvidia/Llama-3.1-8B-Instruct-FP8").weight_format.name == "fp8"  # beside it
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ModelInfoError, match="not valid JSON"):
        read_model_config(tmp_path / "bad.json")
    with pytest.raises(ModelInfoError, match="no such file"):
        read_model_config(tmp_path / "missing.json")


def test_without_huggingface_hub_the_hub_is_not_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    modelinfo.clear_cache()
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)
    with pytest.raises(ModelInfoError, match=r"pip install 'tensorfleet\[hub\]'"):
        resolve_model("Qwen/Qwen3-8B", offline=False)
    modelinfo.clear_cache()


# --- tensorfleet plan ------------------------------------------------------------------------------


def _manifest(tmp_path: Path, name: str, **model: Any) -> Path:
    path = tmp_path / "isvc.yaml"
    path.write_text(yaml.safe_dump(isvc_doc({"model": {"name": name, "maxModelLen": 8192, **model}})))
    return path


def test_plan_model_config_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = DATA / "RedHatAI/Meta-Llama-3.1-70B-Instruct-quantized.w4a16/config.json"
    # A model the catalog does not know, sized from the file alone.
    path = _manifest(tmp_path, "acme/llama-70b-finetune-w4")
    assert main(["plan", "-f", str(path), "--model-config", str(config), "-o", "json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert (summary["modelSource"], summary["weightFormat"], summary["gpusPerReplica"]) == ("file", "int4", 1)
    assert abs(summary["weightBytesTotal"] - (80 * L70_LINEAR * 4.125 / 8 + L70_FIXED * 2)) <= 8
    assert main(["plan", "-f", str(path), "--model-config", str(tmp_path / "nope.json")]) == 1
    assert "--model-config" in capsys.readouterr().err


def test_plan_offline_falls_back_to_the_catalog_and_says_why(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    modelinfo.clear_cache()
    path = _manifest(tmp_path, "RedHatAI/Meta-Llama-3.1-70B-Instruct-quantized.w4a16")
    assert main(["plan", "-f", str(path), "-o", "json", "--offline"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert (summary["modelSource"], summary["weightFormat"]) == ("catalog+id-markers", "int4")
    assert any("config.json not read" in note for note in summary["notes"])
    unknown = _manifest(tmp_path, "acme/secret-model-20b")
    assert main(["plan", "-f", str(unknown), "--offline"]) == 1
    err = capsys.readouterr().err
    assert "not in the catalog" in err and "--model-config" in err and "offline" in err


def test_plan_reads_the_hub_in_a_fresh_process(hub: FakeHub, tmp_path: Path) -> None:
    """`tensorfleet plan` as a user runs it: HF_ENDPOINT and HF_HUB_OFFLINE from the environment."""
    path = _manifest(tmp_path, "Qwen/Qwen2.5-72B-Instruct-GPTQ-Int4")
    env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HUB_OFFLINE": "0", "HF_HUB_CACHE": str(tmp_path / "cache"),
           "PYTHONPATH": str(ROOT / "operator")}
    done = subprocess.run([sys.executable, "-m", "tensorfleet.cli", "plan", "-f", str(path), "-o", "json"],
                          capture_output=True, text=True, env=env, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert (summary["modelSource"], summary["modelRevision"]) == ("hub", commit_of("Qwen/Qwen2.5-72B-Instruct-GPTQ-Int4"))
    assert summary["weightFormat"] == "gptq" and "group 128" in summary["weightDetail"]
    # The same file offline: the cache the first run filled.
    offline = subprocess.run([sys.executable, "-m", "tensorfleet.cli", "plan", "-f", str(path), "-o", "json",
                              "--offline"], capture_output=True, text=True, env=env, timeout=120, check=False)
    assert offline.returncode == 0, offline.stderr
    assert json.loads(offline.stdout)["modelSource"] == "cache"


@pytest.mark.parametrize(("name", "repo"), [
    ("Qwen/Qwen3-8B", True), ("gpt2", True), ("/models/llama", False), ("./llama", False), ("~/llama", False),
    ("a/b/c", False), ("../x", False),
])
def test_repository_ids_are_told_from_paths(name: str, repo: bool) -> None:
    """The operator asks the Hub only for repository ids: a path would be one in the operator's own pod."""
    assert modelinfo.is_repo_id(name) is repo
