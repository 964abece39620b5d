"""`tensorfleet-worker`, the engine pod's entrypoint: run this pod's role (from the env), `health`, `metrics` and
`install-launcher` (the init container's copy). Mistakes a user or the cluster can cause end as one line on stderr
and an exit code (`errors.py`); tracebacks are for bugs only. Design: docs/architecture.md#the-engine-pod.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from tensorfleet import argtypes, contract, extras
from tensorfleet.worker.errors import EXIT_CONFIG, EXIT_NOT_FOUND, WorkerError

if TYPE_CHECKING:
    from tensorfleet.worker.gpu import Thresholds

PROG = contract.WORKER_COMMAND[0]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")
        raise SystemExit(EXIT_CONFIG)



def _xids(text: str) -> frozenset[int]:
    try:
        return frozenset(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of XID numbers") from None


def build_parser() -> argparse.ArgumentParser:
    from tensorfleet.worker.launcher import Options

    defaults = Options()
    parser = _Parser(prog=PROG, description="Run this engine pod's role (vLLM, Ray, or the simulator) from its env.")
    parser.add_argument("--print-command", action="store_true",
                        help="print, as JSON, the commands and env this role would run, and exit")
    parser.add_argument("--state-file", default=defaults.state_path,
                        help=f"where the launcher records its phase for `health` (default {defaults.state_path})")
    parser.add_argument("--cluster-timeout", type=argtypes.positive_float, default=defaults.cluster_timeout, metavar="SECONDS",
                        help=f"leader: how long to wait for every stage to join Ray (default {defaults.cluster_timeout:g})")
    parser.add_argument("--leader-timeout", type=argtypes.positive_float, default=defaults.leader_timeout, metavar="SECONDS",
                        help=f"stage > 0: how long to wait for the leader (default {defaults.leader_timeout:g})")
    parser.add_argument("--leader-lost-after", type=argtypes.positive_float, default=defaults.leader_lost_after, metavar="SECONDS",
                        help=f"stage > 0: restart when the leader is unreachable this long (default {defaults.leader_lost_after:g})")
    parser.add_argument("--poll-interval", type=argtypes.positive_float, default=defaults.poll, metavar="SECONDS",
                        help=f"between checks while waiting (default {defaults.poll:g})")
    parser.add_argument("--log-interval", type=argtypes.positive_float, default=defaults.log_every, metavar="SECONDS",
                        help=f"between progress lines while waiting (default {defaults.log_every:g})")
    parser.add_argument("--watch-interval", type=argtypes.positive_float, default=defaults.watch_interval, metavar="SECONDS",
                        help=f"stage > 0: between checks of the leader once joined (default {defaults.watch_interval:g})")
    parser.add_argument("--kill-after", type=argtypes.positive_float, default=defaults.kill_after, metavar="SECONDS",
                        help="SIGKILL the engine (its whole process group) when it still runs this long after the "
                             f"SIGTERM the launcher sent it (default {defaults.kill_after:g}; the pod's termination "
                             "grace period bounds it too)")
    commands = parser.add_subparsers(dest="command", parser_class=_Parser)

    health = commands.add_parser("health", help="check the GPUs (NVML) and the launcher; exit 0 healthy, 1 unhealthy, 3 no NVML")
    health.add_argument("--json", action="store_true", help="print one JSON object instead of lines")
    _threshold_flags(health)
    health.add_argument("--state-file", dest="health_state_file", default=defaults.state_path,
                        help=f"the launcher's state file (default {defaults.state_path}); '' to skip the launcher check")

    metrics = commands.add_parser("metrics", help="print the GPU gauges in Prometheus format, or serve them")
    metrics.add_argument("--port", type=int, help="serve on this port until stopped instead of printing once")
    _threshold_flags(metrics)

    install = commands.add_parser(
        "install-launcher",
        help="copy the launcher zipapp this image carries into DIR (what a GPU engine pod's init container runs)")
    install.add_argument("directory", metavar="DIR", help=f"where to put {Path(contract.LAUNCHER_PATH).name}")
    install.add_argument("--from", dest="source", default=contract.LAUNCHER_BUNDLE_PATH, metavar="PATH",
                         help=f"the bundle to copy (default {contract.LAUNCHER_BUNDLE_PATH})")
    return parser


def _threshold_flags(parser: argparse.ArgumentParser) -> None:
    from tensorfleet.worker.gpu import DEFAULT_FATAL_XIDS

    parser.add_argument("--max-temperature", type=float, metavar="CELSIUS",
                        help="unhealthy at or above this (default: each GPU's own slowdown temperature, else 85)")
    parser.add_argument("--max-ecc-uncorrectable", type=int, default=0, metavar="N",
                        help="unhealthy above this many volatile uncorrectable ECC errors (default 0)")
    parser.add_argument("--max-memory-percent", type=float, metavar="PERCENT",
                        help="unhealthy above this memory use (default: not judged; vLLM fills memory by design)")
    parser.add_argument("--min-gpus", type=int, metavar="N",
                        help=f"unhealthy with fewer GPUs visible (default: {contract.ENV_TENSOR_PARALLEL})")
    parser.add_argument("--fatal-xids", type=_xids, default=DEFAULT_FATAL_XIDS, metavar="LIST",
                        help=f"XIDs that make a GPU unhealthy (default {','.join(map(str, sorted(DEFAULT_FATAL_XIDS)))})")


def _thresholds(args: argparse.Namespace, min_gpus: int | None = None) -> Thresholds:
    from tensorfleet.worker.gpu import Thresholds

    return Thresholds(
        max_temperature_c=args.max_temperature,
        max_ecc_uncorrectable=args.max_ecc_uncorrectable,
        max_memory_percent=args.max_memory_percent,
        min_gpus=args.min_gpus if args.min_gpus is not None else min_gpus,
        fatal_xids=args.fatal_xids,
    )


def _cmd_health(args: argparse.Namespace) -> int:
    from tensorfleet.worker.health import check

    result = check(os.environ, thresholds=_thresholds(args), state_path=args.health_state_file or None,
                   min_gpus=args.min_gpus)
    if args.json:
        print(json.dumps(result.document, indent=2, default=str))
    else:
        print("\n".join(result.lines))
    return result.code


def _cmd_metrics(args: argparse.Namespace) -> int:
    extras.require(f"{PROG} metrics", "worker")
    from tensorfleet.worker import metrics
    from tensorfleet.worker.role import health_settings

    _, tensor = health_settings(os.environ)
    collector = metrics.GpuCollector(_thresholds(args, tensor))
    if args.port is None:
        sys.stdout.write(metrics.exposition(collector))
        return 0
    try:
        metrics.serve(args.port, collector)
    except OSError as exc:
        raise WorkerError(f"--port {args.port}: cannot listen: {exc.strerror or exc}") from None
    sys.stderr.write(f"{PROG}: serving GPU metrics on :{args.port}{contract.METRICS_PATH}\n")
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    return 0


def _cmd_install_launcher(args: argparse.Namespace) -> int:
    from tensorfleet.worker.bundle import install

    info = install(Path(args.directory), Path(args.source))
    print(f"{PROG}: installed {info.line()}")
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    if not args.print_command:
        # The GPU metrics exporter and the drain (which reads the engine's
        # /metrics) use prometheus_client; printing the plan needs nothing.
        extras.require(PROG, "worker")
    from tensorfleet.worker.command import engine_environ, print_document
    from tensorfleet.worker.launcher import Launcher, Options
    from tensorfleet.worker.role import role_from_env

    role = role_from_env(os.environ)
    if args.print_command:
        print(json.dumps(print_document(role, engine_environ(role, os.environ, os.sched_getaffinity(0))), indent=2))
        return 0
    options = Options(
        state_path=args.state_file or None,
        cluster_timeout=args.cluster_timeout,
        leader_timeout=args.leader_timeout,
        leader_lost_after=args.leader_lost_after,
        poll=args.poll_interval,
        log_every=args.log_interval,
        watch_interval=args.watch_interval,
        supervise_poll=min(0.5, args.poll_interval),
        kill_after=args.kill_after,
    )
    return Launcher(role, os.environ, options).run()


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handler = {
        "health": _cmd_health, "metrics": _cmd_metrics, "install-launcher": _cmd_install_launcher,
    }.get(args.command or "", _cmd_run)
    try:
        return handler(args)
    except WorkerError as exc:
        sys.stderr.write(f"{PROG}: error: {exc}\n")
        return exc.code
    except extras.MissingExtra as exc:
        # The line names the command already, as `tensorfleet`'s do.
        sys.stderr.write(f"error: {exc}\n")
        return EXIT_NOT_FOUND
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
