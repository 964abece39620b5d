"""The launcher as one file: a reproducible zipapp, carried by the control-plane image and copied into engine pods,
that any vLLM image's own Python runs with the image's pydantic 2, so nothing of Tensorfleet is installed there.
Build it where the worker extra is installed (the image builds do): `python -m tensorfleet.worker.bundle OUT.pyz`.
Design: docs/architecture.md#the-engine-pod.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import sys
import tempfile
import zipfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path, PurePosixPath
from typing import Any

from tensorfleet import contract
from tensorfleet.worker.errors import EXIT_CONFIG, EXIT_NOT_FOUND, WorkerError

# The worker extra's dependencies that travel inside the bundle, pure Python. vLLM images may lack nvidia-ml-py
# (vLLM vendors its own pynvml) and pin another prometheus-client; the launcher's copies come first on its
# sys.path and never reach vLLM, a separate process.
BUNDLED_DISTRIBUTIONS = ("prometheus-client", "nvidia-ml-py")
# What the bundle relies on the engine image for (besides the standard library). pydantic's compiled core must
# match the interpreter, so it cannot travel in the zip; every vLLM release requires pydantic 2.
IMAGE_REQUIREMENTS = ("pydantic>=2.6,<3",)
MIN_PYTHON = (3, 10)
MANIFEST = "LAUNCHER.json"
# Subpackages of tensorfleet left out: the test harness needs the dev extra.
EXCLUDED_SUBPACKAGES = ("testing",)
# Files of an installed distribution that describe that installation, not the code.
_INSTALL_RECORDS = {"RECORD", "INSTALLER", "REQUESTED", "direct_url.json"}
_COMPILED_SUFFIXES = (".so", ".pyd", ".dylib", ".dll")
_ZIP_DATE = (1980, 1, 1, 0, 0, 0)
_SHEBANG = b"#!/usr/bin/env python3\n"

# Parses on any Python 3, so an old interpreter gets the one-line message.
MAIN = '''\
# The Tensorfleet engine launcher (tensorfleet-worker) as a zipapp; see
# tensorfleet/worker/bundle.py. Run it with the engine image's Python.
import sys


def _fail(message):
    sys.stderr.write("tensorfleet-worker: error: " + message + "\\n")
    raise SystemExit(127)


if sys.version_info < {min_python!r}:
    _fail("the launcher needs Python >= {min_text}; %s is %d.%d" % ((sys.executable,) + tuple(sys.version_info[:2])))
try:
    import pydantic
except ImportError as exc:
    _fail("the launcher needs pydantic 2 in the engine image's Python (%s), as vLLM images have: %s" % (sys.executable, exc))
if not str(getattr(pydantic, "VERSION", "")).startswith("2."):
    _fail("the launcher needs pydantic 2; %s has %s" % (sys.executable, getattr(pydantic, "VERSION", "unknown")))

from tensorfleet.worker.cli import main

raise SystemExit(main())
'''


@dataclass(frozen=True)
class BundleInfo:
    path: Path
    size: int
    sha256: str
    manifest: dict[str, Any]

    def line(self) -> str:
        dists = ", ".join(f"{name} {version}" for name, version in self.manifest["distributions"].items())
        return (f"{self.path}: tensorfleet {self.manifest['tensorfleet']} launcher with {dists}; "
                f"{self.size // 1024} KiB, sha256 {self.sha256}")


def package_dir() -> Path:
    """The directory of the tensorfleet package this code runs from (a checkout or an install)."""
    import tensorfleet

    return Path(tensorfleet.__file__).resolve().parent


def _package_files(root: Path) -> Iterator[tuple[str, Path]]:
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        if "__pycache__" in relative.parts or (len(relative.parts) > 1 and relative.parts[0] in EXCLUDED_SUBPACKAGES):
            continue
        yield str(PurePosixPath("tensorfleet", *relative.parts)), path


def _find_distribution(name: str, search_path: Sequence[str] | None) -> metadata.Distribution:
    found = list(metadata.distributions(name=name, path=list(search_path) if search_path is not None else sys.path))
    if not found:
        raise WorkerError(f"{name} is not installed here, so it cannot be bundled: pip install 'tensorfleet[worker]'",
                          EXIT_NOT_FOUND)
    return found[0]


def _distribution_files(dist: metadata.Distribution) -> Iterator[tuple[str, Path]]:
    name = dist.metadata["Name"]
    if dist.files is None:
        raise WorkerError(f"{name} {dist.version} has no RECORD of its files, so it cannot be bundled")
    for file in sorted(dist.files, key=str):
        parts = PurePosixPath(str(file)).parts
        # Scripts installed outside site-packages (../../bin) and byte code stay behind.
        if ".." in parts or "__pycache__" in parts or file.suffix == ".pyc":
            continue
        if parts[0].endswith(".dist-info") and parts[-1] in _INSTALL_RECORDS:
            continue
        if str(file).endswith(_COMPILED_SUFFIXES):
            raise WorkerError(f"{name} {dist.version} ships compiled code ({file}); "
                              "the launcher bundle holds pure-Python distributions only")
        yield str(PurePosixPath(*parts)), Path(str(dist.locate_file(file)))


def _entry(name: str, mode: int = 0o644) -> zipfile.ZipInfo:
    info = zipfile.ZipInfo(name, date_time=_ZIP_DATE)
    info.compress_type = zipfile.ZIP_DEFLATED
    info.external_attr = (0o100000 | mode) << 16
    return info


def archive(files: dict[str, bytes]) -> bytes:
    """A zipapp of FILES (name -> content): the shebang line, then a reproducible zip."""
    buffer = io.BytesIO()
    buffer.write(_SHEBANG)
    with zipfile.ZipFile(buffer, "w") as zf:
        for name in sorted(files):
            zf.writestr(_entry(name), files[name], compresslevel=9)
    return buffer.getvalue()


def contents(*, source: Path | None = None, search_path: Sequence[str] | None = None) -> dict[str, bytes]:
    """What the bundle holds, name -> bytes: the package at SOURCE (default: this one) and its dependencies.

    The zip's root is sys.path[0] when it runs:

      __main__.py     checks for Python >= 3.10 and pydantic 2 (one line and exit 127 otherwise), then runs
                      `tensorfleet.worker.cli`
      LAUNCHER.json   what was bundled (Tensorfleet's version, each distribution's) and what the engine image
                      must provide
      tensorfleet/    this package's modules (all but `tensorfleet.testing`; the launcher imports only its own
                      and what they need)
      prometheus_client/, pynvml.py and their *.dist-info (licences): BUNDLED_DISTRIBUTIONS

    A distribution with compiled files is refused here rather than failing in a pod: zipimport cannot load
    extension modules.
    """
    files: dict[str, bytes] = {}
    for name, path in _package_files(source or package_dir()):
        files[name] = path.read_bytes()
    versions: dict[str, str] = {}
    for dist_name in BUNDLED_DISTRIBUTIONS:
        dist = _find_distribution(dist_name, search_path)
        versions[dist.metadata["Name"]] = dist.version
        for name, path in _distribution_files(dist):
            if name in files:
                raise WorkerError(f"{dist_name} and another bundled distribution both have {name}")
            files[name] = path.read_bytes()
    manifest = {
        "tensorfleet": contract.__version__,
        "distributions": versions,
        "python": ">=" + ".".join(map(str, MIN_PYTHON)),
        "fromImage": list(IMAGE_REQUIREMENTS),
    }
    files[MANIFEST] = (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode()
    files["__main__.py"] = MAIN.format(min_python=MIN_PYTHON, min_text=".".join(map(str, MIN_PYTHON))).encode()
    return files


def build(out: Path, *, source: Path | None = None, search_path: Sequence[str] | None = None) -> BundleInfo:
    """Write the launcher bundle to OUT (atomically)."""
    data = archive(contents(source=source, search_path=search_path))
    _write_atomically(data, out, mode=0o755)
    return inspect(out)


def inspect(path: Path) -> BundleInfo:
    """The bundle at PATH, checked to be one (a zip with the launcher and its manifest)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise WorkerError(f"no launcher bundle at {path}", EXIT_NOT_FOUND) from None
    except OSError as exc:
        raise WorkerError(f"cannot read the launcher bundle {path}: {exc.strerror or exc}") from None
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as zf:
            names = set(zf.namelist())
            missing = {"__main__.py", MANIFEST, "tensorfleet/worker/cli.py"} - names
            if missing:
                raise WorkerError(f"{path} is not a launcher bundle: it lacks {', '.join(sorted(missing))}")
            manifest = json.loads(zf.read(MANIFEST))
    except (zipfile.BadZipFile, ValueError) as exc:
        raise WorkerError(f"{path} is not a launcher bundle: {exc}") from None
    return BundleInfo(path=path, size=len(data), sha256=hashlib.sha256(data).hexdigest(), manifest=manifest)


def _write_atomically(data: bytes, out: Path, mode: int) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.chmod(tmp, mode)
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def install(directory: Path, source: Path = Path(contract.LAUNCHER_BUNDLE_PATH)) -> BundleInfo:
    """Copy the bundle at SOURCE into DIRECTORY (what the engine pod's init container runs).

    Written under a temporary name and renamed, readable by every uid: the
    engine container runs as another user than this one.
    """
    if not source.exists():
        raise WorkerError(f"no launcher bundle at {source}: this image was built without it (the control-plane "
                          "image's builds, images/build-control-plane and ./Dockerfile, put it there)", EXIT_NOT_FOUND)
    bundle = inspect(source)
    target = directory / Path(contract.LAUNCHER_PATH).name
    if not directory.is_dir():
        raise WorkerError(f"{directory} is not a directory (the launcher volume is mounted there in engine pods)",
                          EXIT_CONFIG)
    try:
        _write_atomically(source.read_bytes(), target, mode=0o755)
    except OSError as exc:
        raise WorkerError(f"cannot write the launcher to {directory}: {exc.strerror or exc}") from None
    installed = inspect(target)
    if installed.sha256 != bundle.sha256:
        raise WorkerError(f"{target} differs from {source} after copying")
    return installed


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tensorfleet.worker.bundle",
                                     description="Build the launcher zipapp the control-plane image carries.")
    parser.add_argument("out", type=Path, help=f"where to write it (images put it at {contract.LAUNCHER_BUNDLE_PATH})")
    parser.add_argument("--path", action="append", dest="search_path", metavar="DIR",
                        help="look for the bundled distributions only here (repeatable; default: sys.path)")
    args = parser.parse_args(argv)
    try:
        info = build(args.out, search_path=args.search_path)
    except WorkerError as exc:
        sys.stderr.write(f"{parser.prog}: error: {exc}\n")
        return exc.code
    print(info.line())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
