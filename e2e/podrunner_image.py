"""The e2e pod runner's stand-ins for the images' own files: the control-plane image's launcher bundle
(LAUNCHER_BUNDLE_PATH, built from this checkout by `launcher_bundle`, cached by content under $TF_E2E_CACHE/launcher/,
laid over this machine's /opt through `image_overlays`) and, for vLLM's image, torch's precompiled headers shared
between pods (`share_header_cache`). Part of the pod runner, e2e/podrunner.py; what a vLLM engine pod gets of them:
e2e/README.md#real-vllm-engine-pods.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

from podrunner_spec import VENV_BIN, pod_private

# Files of the control-plane image that are not the venv's: the launcher zipapp the Dockerfile builds
# (`python -m tensorfleet.worker.bundle /opt/tensorfleet/launcher.pyz`), which the init container of
# a vLLM engine pod copies out (`tensorfleet-worker install-launcher DIR`). The runner builds it from
# this checkout (`launcher_bundle`, cached by content) and lays it over this machine's /opt inside
# the container's own mount namespace (a read-only overlayfs; nothing is written to /opt).
LAUNCHER_BUNDLE_PATH = "/opt/tensorfleet/launcher.pyz"   # contract.LAUNCHER_BUNDLE_PATH


def cache_dir() -> Path:
    """e2e/cluster's cache ($TF_E2E_CACHE, default ~/.cache/tensorfleet)."""
    return Path(os.environ.get("TF_E2E_CACHE") or Path.home() / ".cache" / "tensorfleet")


def share_header_cache(pod_tmp: Path, env: dict[str, str]) -> None:
    """Point torch's precompiled C++ headers in a pod's /tmp (POD_TMP here) at the shared cache's.

    torch keeps them in `$TMPDIR/torchinductor_$USER` whatever TORCHINDUCTOR_CACHE_DIR says, so every new pod's
    /tmp built them again: a rollout's new engine took minutes to warm up on two cores serving streams."""
    if env.get("TMPDIR", "/tmp").rstrip("/") != "/tmp":
        return
    # getpass.getuser()'s order, and the name as torch's default_cache_dir() sanitises it.
    user = next((env[k] for k in ("LOGNAME", "USER", "LNAME", "USERNAME") if env.get(k)), None)
    if user is None:
        import pwd
        user = pwd.getpwuid(os.getuid()).pw_name
    shared = cache_dir() / "vllm-cpu" / "precompiled-headers"
    shared.mkdir(parents=True, exist_ok=True)
    own = pod_tmp / ("torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))
    own.mkdir(exist_ok=True)
    link = own / "precompiled_headers"
    if not link.is_symlink() and not link.exists():
        link.symlink_to(shared, target_is_directory=True)


_bundle_lock = threading.Lock()
_package: list[Path] = []
BUNDLES_KEPT = 4


def _package_dir() -> Path:
    """The tensorfleet package the venv imports (this checkout's, installed editable)."""
    if not _package:
        done = subprocess.run([str(VENV_BIN / "python"), "-c", "import tensorfleet; print(tensorfleet.__file__)"],
                              capture_output=True, text=True, timeout=60, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{VENV_BIN / 'python'} cannot import tensorfleet: {done.stderr.strip()[-500:]}")
        _package.append(Path(done.stdout.strip()).resolve().parent)
    return _package[0]


def _bundle_key(package: Path) -> str:
    """What the bundle is made of: every module of the package, and the venv's copies of the distributions
    bundle.py puts in (prometheus-client, nvidia-ml-py), by their installed versions."""
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        relative = path.relative_to(package)
        if "__pycache__" not in relative.parts:
            digest.update(f"{relative}\0".encode() + path.read_bytes() + b"\0")
    for info in sorted(VENV_BIN.parent.glob("lib/python*/site-packages/*.dist-info")):
        if info.name.lower().startswith(("prometheus_client-", "nvidia_ml_py-")):
            digest.update(info.name.encode() + b"\0")
    return digest.hexdigest()[:16]


def launcher_bundle(cache: Path | None = None) -> Path:
    """A folder standing for the control-plane image's root with LAUNCHER_BUNDLE_PATH in it, the zipapp built
    from the venv's tensorfleet (this checkout) as the Dockerfile builds it; made once per content
    ($TF_E2E_CACHE/launcher/KEY), so a change to the working tree makes a new one at the next container start."""
    relative = LAUNCHER_BUNDLE_PATH.lstrip("/")
    with _bundle_lock:
        package = _package_dir()
        folder = (cache or cache_dir()) / "launcher"
        root = folder / _bundle_key(package)
        if (root / relative).is_file():
            return root
        folder.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{root.name}.", dir=folder))
        try:
            (staging / relative).parent.mkdir(parents=True)
            done = subprocess.run([str(VENV_BIN / "python"), "-m", "tensorfleet.worker.bundle", str(staging / relative)],
                                  capture_output=True, text=True, timeout=300, check=False)
            if done.returncode != 0:
                raise RuntimeError(f"python -m tensorfleet.worker.bundle failed: {done.stderr.strip()[-1000:]}")
            staging.rename(root)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        for old in sorted((p for p in folder.iterdir() if not p.name.startswith(".")),
                          key=lambda p: p.stat().st_mtime)[:-BUNDLES_KEPT]:
            shutil.rmtree(old, ignore_errors=True)
        return root


def image_overlays(root: Path) -> list[list[str]]:
    """[lower, target] for each folder of this machine the image's own files go into: the deepest folder above
    each file that exists here (/opt), overlaid (read-only) with ROOT's copy of it, which holds the file."""
    overlays: list[list[str]] = []
    for path in sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()):
        target = Path("/", path).parent
        while not target.is_dir():
            target = target.parent
        if target == Path("/") or pod_private(str(target)):
            raise RuntimeError(f"/{path}: no folder above it exists on this machine but / (or /tmp, /run)")
        pair = [str(root / str(target).lstrip("/")), str(target)]
        if pair not in overlays:
            overlays.append(pair)
    return overlays
