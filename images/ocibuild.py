"""What images/build-control-plane and images/check-control-plane share.

The control-plane image is built without a container engine, from Debian's own
tools: `mmdebstrap` makes the base layer (a minimal Debian with python3), the
image's own Python installs our wheel and its dependencies under `chroot`, and
`umoci` writes the OCI image layout. `skopeo` (optional) pushes it.

Only the Python standard library, plus `tensorfleet.contract` from this
checkout (pure: names and numbers, no dependencies).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO / "operator"))

from tensorfleet import contract  # the checkout's, found through the line above

PACKAGES_FILE = HERE / "control-plane.packages"
SUITE = "bookworm"
# The image's PATH: Debian's python3 and the scripts pip installs in /usr/local/bin.
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# The Dockerfile's equivalents: EXPOSE and the user the chart and the renderer expect.
EXPOSED_PORTS = (contract.OPERATOR_HEALTH_PORT, contract.OPERATOR_METRICS_PORT, contract.OPERATOR_WEBHOOK_PORT)
USER = f"{contract.CONTROL_PLANE_UID}:{contract.CONTROL_PLANE_UID}"
USER_NAME = "nonroot"
ENTRYPOINT = list(contract.ROUTER_COMMAND[:1])  # `tensorfleet`
ENV = ("PYTHONUNBUFFERED=1", "PYTHONDONTWRITEBYTECODE=1", f"PATH={PATH}")
# The extras the image installs: the control plane, and the worker extra so the
# image can bundle the launcher (tensorfleet.worker.bundle) and run it.
EXTRAS = "control-plane,worker"
TAG = contract.__version__
ARCHITECTURES = {"x86_64": "amd64", "aarch64": "arm64"}


class Failure(Exception):
    """Printed as one line, exit 1."""


def cache_dir() -> Path:
    return Path(os.environ.get("TF_IMAGE_CACHE") or Path.home() / ".cache" / "tensorfleet" / "images")


def default_layout() -> Path:
    return cache_dir() / "control-plane"


def say(message: str) -> None:
    print(f"== {message}", file=sys.stderr, flush=True)


def run(argv: Sequence[str], *, quiet: bool = False, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """Run ARGV, echoed; a failure names the command and ends the build."""
    print("+ " + shlex.join(str(a) for a in argv), file=sys.stderr, flush=True)
    if quiet:
        kwargs.setdefault("stdout", subprocess.DEVNULL)
    # Found on this host's PATH, whatever PATH the command itself gets.
    command = [shutil.which(str(argv[0])) or str(argv[0]), *(str(a) for a in argv[1:])]
    try:
        return subprocess.run(command, check=True, text=True, **kwargs)
    except subprocess.CalledProcessError as exc:
        raise Failure(f"{Path(str(argv[0])).name} failed (exit {exc.returncode}): {shlex.join(str(a) for a in argv)}"
                      ) from None


def require(tools: Sequence[str], *, root: bool = True) -> None:
    missing = [tool for tool in tools if shutil.which(tool) is None]
    if missing:
        raise Failure(f"{', '.join(missing)} not installed: apt-get install {' '.join(missing)} (Debian, Ubuntu)")
    if root and os.geteuid() != 0:
        raise Failure("needs root: mmdebstrap builds the base and chroot runs the image's Python (CI runs as root)")


def architecture() -> str:
    machine = platform.machine()
    if machine not in ARCHITECTURES:
        raise Failure(f"no image build for {machine}; known: {', '.join(ARCHITECTURES)}")
    return ARCHITECTURES[machine]


def packages() -> list[str]:
    lines = (line.split("#", 1)[0].strip() for line in PACKAGES_FILE.read_text().splitlines())
    return [line for line in lines if line]


def digest(*parts: str) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:12]


class Timer:
    def __init__(self) -> None:
        self.start = time.monotonic()
        self.marks: list[tuple[str, float]] = []

    def mark(self, name: str) -> None:
        self.marks.append((name, time.monotonic() - self.start - sum(t for _, t in self.marks)))

    def summary(self) -> str:
        return ", ".join(f"{name} {seconds:.0f}s" for name, seconds in self.marks) + \
            f"; total {time.monotonic() - self.start:.0f}s"


# --- the OCI image layout (read side: what check and tests look at) ------------------


def _blob(layout: Path, descriptor: dict[str, Any]) -> Any:
    algorithm, _, value = descriptor["digest"].partition(":")
    return json.loads((layout / "blobs" / algorithm / value).read_text())


def manifest_and_config(layout: Path, tag: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The image manifest and config of TAG in the OCI layout at LAYOUT."""
    index_path = layout / "index.json"
    if not index_path.is_file():
        raise Failure(f"{layout} is not an OCI image layout (no index.json): run images/build-control-plane first")
    index = json.loads(index_path.read_text())
    for descriptor in index.get("manifests", []):
        if descriptor.get("annotations", {}).get("org.opencontainers.image.ref.name") == tag:
            manifest = _blob(layout, descriptor)
            return manifest, _blob(layout, manifest["config"])
    raise Failure(f"{layout} has no image tagged {tag}")
