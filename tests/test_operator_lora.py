"""The operator with LoRA adapters (emulated API server): status.adapters, events, and no restarts."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from conftest import existing, existing_isvc, sim_doc

from tensorfleet.api.models import AdapterSpec
from tensorfleet.controller.adapters import Engine, EngineResult
from tensorfleet.testing.operator_harness import cluster, running_operator
from tensorfleet.testing.wait import eventually

pytestmark = pytest.mark.asyncio

STS = ("apps/v1", "statefulsets")


class Engines:
    """What the operator's adapter sync reaches: each engine's adapters, in memory; some sources refused."""

    def __init__(self, refused: Sequence[str] = ()) -> None:
        self.served: dict[str, set[str]] = {}
        self.refused = set(refused)
        self.seen: list[list[Engine]] = []

    async def __call__(self, engines: Sequence[Engine], wanted: Sequence[AdapterSpec]) -> dict[str, EngineResult]:
        self.seen.append(list(engines))
        out: dict[str, EngineResult] = {}
        for engine in engines:
            served = self.served.setdefault(engine.pod, set())
            served &= {a.name for a in wanted}
            # What the operator's adapter sync makes of vLLM 0.19.1's answer (404) for an adapter it cannot find.
            failures = {a.name: f"404: Loading lora {a.name} failed: No adapter found for {a.source}"
                        for a in wanted if a.source in self.refused}
            served |= {a.name for a in wanted if a.source not in self.refused}
            out[engine.pod] = EngineResult(served=set(served), failures=failures)
        return out


def adapters(*names: str) -> list[dict[str, Any]]:
    return [{"name": n, "source": f"org/{n}"} for n in names]


def states(c: Any) -> list[tuple[str, str, int]]:
    return [(a["name"], a["state"], a["engines"]) for a in (c.isvc("demo").get("status") or {}).get("adapters") or []]


async def test_adapters_are_loaded_into_ready_engines_and_adding_one_restarts_nothing() -> None:
    engines = Engines()
    async with cluster() as c, c.workloads(), running_operator(c) as op:
        op.reconciler.adapter_sync = engines
        await c.create(sim_doc(adapters=adapters("a", "b", "c")))
        await eventually(lambda: states(c) == [("a", "Loaded", 2), ("b", "Loaded", 2), ("c", "Loaded", 2)],
                         message="three adapters loaded on both engines")
        assert all(e.url.startswith("http://10.244.") for e in engines.seen[-1]) and len(engines.seen[-1]) == 2
        sts = existing(c, *STS, "demo-stage-0")
        template = sts["spec"]["template"]
        env = {v["name"]: v.get("value") for v in template["spec"]["containers"][0]["env"]}
        assert env["TF_ENABLE_LORA"] == "true" and env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
        await c.patch("demo", {"spec": {"adapters": adapters("a", "b", "c", "d")}})
        await eventually(lambda: ("d", "Loaded", 2) in states(c), message="the added adapter loaded")
        after = existing(c, *STS, "demo-stage-0")
        assert after["spec"]["template"] == template, "adding an adapter changed the engines' pod template"
        assert after["metadata"]["generation"] == sts["metadata"]["generation"]
        await c.patch("demo", {"spec": {"adapters": adapters("a", "d")}})
        await eventually(lambda: states(c) == [("a", "Loaded", 2), ("d", "Loaded", 2)], message="two removed")
        assert all(served == {"a", "d"} for served in engines.served.values())


async def test_an_adapter_the_engines_refuse_is_failed_with_an_event() -> None:
    engines = Engines(refused=["org/bad"])
    async with cluster() as c, c.workloads(), running_operator(c) as op:
        op.reconciler.adapter_sync = engines
        await c.create(sim_doc(adapters=adapters("good", "bad")))
        await eventually(lambda: states(c) == [("good", "Loaded", 2), ("bad", "Failed", 0)], message="bad failed")
        bad = existing_isvc(c, "demo")["status"]["adapters"][1]
        assert "No adapter found" in bad["message"]
        await eventually(lambda: any(e["reason"] == "AdapterLoadFailed" and "bad" in e["message"]
                                     for e in c.events("demo")), message="a Warning event")
        # The service still serves: a bad adapter is not a bad engine.
        await eventually(lambda: (c.condition("demo", "Ready") or {}).get("status") == "True", message="Ready")
        assert states(c) == [("good", "Loaded", 2), ("bad", "Failed", 0)]
