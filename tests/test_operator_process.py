"""`tensorfleet run` as a real process: kubeconfig, health, metrics, clean shutdown."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import aiohttp
import pytest
import yaml
from conftest import existing, isvc_doc

from tensorfleet.testing import loopback
from tensorfleet.testing.operator_harness import cluster
from tensorfleet.testing.wait import eventually

pytestmark = pytest.mark.asyncio



async def _get(url: str) -> tuple[int, str]:
    try:
        async with aiohttp.ClientSession() as session, session.get(url) as response:
            return response.status, await response.text()
    except aiohttp.ClientError:
        return 0, ""


async def test_run_command_serves_against_a_kubeconfig(tmp_path: Path) -> None:
    async with cluster() as c:
        kubeconfig = tmp_path / "config"
        kubeconfig.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "emu",
            "clusters": [{"name": "emu", "cluster": {"server": c.url}}],
            "users": [{"name": "nobody", "user": {"token": "t0ken"}}],
            "contexts": [{"name": "emu", "context": {"cluster": "emu", "user": "nobody"}}],
        }))
        health, metrics = loopback.free_port(), loopback.free_port()
        # A file, not a pipe: a full pipe would block the operator.
        with open(tmp_path / "operator.log", "wb") as log:  # noqa: ASYNC230 - a local tmp file; opens at once
            process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "tensorfleet.cli", "run", "--namespace", "default",
                "--health-port", str(health), "--metrics-port", str(metrics), "--lease-namespace", "default",
                "--log-format", "json",
                env={**os.environ, "KUBECONFIG": str(kubeconfig)},
                stdout=log, stderr=asyncio.subprocess.STDOUT)
            failure: BaseException | None = None
            try:
                await c.create(isvc_doc({"engine": {"kind": "simulator"}, "accelerator": {"type": "L4"}}))
                await eventually(lambda: c.get("apps/v1", "statefulsets", "demo-stage-0"), timeout=30,
                                 message="reconciled")
                lease = c.get("coordination.k8s.io/v1", "leases", "tensorfleet-operator")
                assert lease and lease["spec"]["holderIdentity"]
                assert (await _get(f"http://127.0.0.1:{health}/healthz"))[0] == 200
                assert (await _get(f"http://127.0.0.1:{health}/readyz"))[0] == 200
                metrics_url = f"http://127.0.0.1:{metrics}/metrics"

                async def reconciled_ok() -> bool:
                    status, text = await _get(metrics_url)
                    # ... and the watch events of the InferenceService and of the StatefulSet it wrote counted.
                    return status == 200 and 'tensorfleet_reconciles_total{result="ok"}' in text and \
                        'tensorfleet_watch_events_total{kind="InferenceService"' in text and \
                        'tensorfleet_watch_events_total{kind="StatefulSet"' in text

                # The StatefulSet is written partway through the first reconcile; its count follows its end.
                await loopback.eventually(reconciled_ok, timeout=10)
                status, text = await _get(metrics_url)
                assert status == 200 and 'tensorfleet_reconciles_total{result="ok"}' in text
                assert "tensorfleet_api_requests_total" in text and 'tensorfleet_leader 1.0' in text
                # The token from the kubeconfig reached the API server.
                assert any(r.headers.get("Authorization") == "Bearer t0ken" for r in c.requests())
            except BaseException as exc:  # noqa: BLE001 - harness: re-raised below with the operator's output
                failure = exc
            finally:
                if process.returncode is None:
                    process.send_signal(signal.SIGTERM)
                await asyncio.wait_for(process.wait(), 30)
        output = (tmp_path / "operator.log").read_bytes()
        if failure is not None:
            raise AssertionError(f"{failure}\n--- operator output ---\n{output.decode()[-3000:]}") from failure
        assert process.returncode == 0, output.decode()[-2000:]
        assert "Traceback" not in output.decode()
        # The lease is released on a clean exit, so a standby need not wait for it to expire.
        assert not existing(c, "coordination.k8s.io/v1", "leases", "tensorfleet-operator")["spec"].get("holderIdentity")
