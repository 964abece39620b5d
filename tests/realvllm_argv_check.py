"""Runs under the real vLLM's interpreter (tensorfleet.testing.realvllm.run_script), not in the suite's.

Reads {"cases": [{"name", "argv", "model", "env"}]} as JSON on stdin. For each case it parses the argv as
`vllm serve` parses its command line (vLLM's own FlexibleArgumentParser with the serve subcommand that
vllm/entrypoints/cli/main.py builds, then the serve subcommand's own `validate`), puts `model` (a local
checkpoint folder) where the argv's model positional was, as the serve command does with its positional
(`args.model = args.model_tag`), and, with the case's `env` (the pod's VLLM_* variables) set, builds the
engine's configuration as the OpenAI server does
(`AsyncEngineArgs.from_cli_args(args).create_engine_config(usage_context=OPENAI_API_SERVER)`): the
model's config.json, every cross-check of the config classes, and the platform's (here CPU) own
adjustments. Nothing is loaded and no engine starts.

Ray: an argv that runs over Ray (`--distributed-executor-backend ray`) fails its config where Ray is not
installed (the CPU build's venv has none; vLLM images do). Then the same argv is checked once more with
that one value swapped for `mp`, so every other flag is still judged ("config_without_ray").

Prints one JSON line: {"vllm": version, "cpu_batch_defaults": {world size: [max_num_batched_tokens, max_num_seqs]} as vLLM
defaults them for the OpenAI server on this (CPU) platform with 1, 2 and 4 workers, "results": [{"name", "parse",
"config", "config_without_ray" (each an error message or null), "built": what the config holds (block size,
max_num_seqs, max_num_batched_tokens, the CPU KV cache bytes) when it was built}]}, in the cases' order.
"""

import argparse
import contextlib
import io
import json
import os
import sys
from typing import Any


def main() -> None:
    payload = json.load(sys.stdin)
    import vllm
    from vllm.engine.arg_utils import AsyncEngineArgs, EngineArgs
    from vllm.entrypoints.cli import serve
    from vllm.usage.usage_lib import UsageContext
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    from vllm.v1.executor import ray_utils

    def parse(argv: list[str]) -> argparse.Namespace:
        # What vllm/entrypoints/cli/main.py builds, with only the serve subcommand.
        top = FlexibleArgumentParser(prog="vllm")
        commands = top.add_subparsers(required=False, dest="subparser")
        for command in serve.cmd_init():
            command.subparser_init(commands).set_defaults(dispatch_function=command.cmd)
        args = top.parse_args(argv[1:])
        serve.ServeSubcommand().validate(args)
        return args

    def config(args: argparse.Namespace, model: str, env: dict[str, str], result: dict[str, Any]) -> str | None:
        args.model_tag = None
        args.model = model
        saved = {name: os.environ.get(name) for name in env}
        os.environ.update(env)
        try:
            built = AsyncEngineArgs.from_cli_args(args).create_engine_config(
                usage_context=UsageContext.OPENAI_API_SERVER)
        except Exception as exc:  # noqa: BLE001 - reported per case
            return f"{type(exc).__name__}: {' '.join(str(exc).split())}"
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
        result["built"] = {
            "block_size": built.cache_config.block_size,
            "max_num_seqs": built.scheduler_config.max_num_seqs,
            "max_num_batched_tokens": built.scheduler_config.max_num_batched_tokens,
            "cpu_kvcache_space_bytes": getattr(built.cache_config, "cpu_kvcache_space_bytes", None),
        }
        return None

    results = []
    for case in payload["cases"]:
        result = {"name": case["name"], "parse": None, "config": None, "config_without_ray": None, "built": None}
        results.append(result)
        argv, model, env = case["argv"], case["model"], case.get("env", {})
        if argv[:2] != ["vllm", "serve"]:
            result["parse"] = f"not a `vllm serve` command line: {argv[:2]}"
            continue
        errors = io.StringIO()
        try:
            with contextlib.redirect_stderr(errors):
                args = parse(argv)
        except SystemExit as exc:
            lines = errors.getvalue().strip().splitlines()
            result["parse"] = lines[-1] if lines else f"exit {exc.code}"
            continue
        except Exception as exc:  # noqa: BLE001 - reported per case
            result["parse"] = f"{type(exc).__name__}: {exc}"
            continue
        over_ray = args.distributed_executor_backend == "ray"
        result["config"] = config(args, model, env, result)
        if result["config"] is not None and over_ray and not ray_utils.ray_is_available():
            args = parse(argv)
            args.distributed_executor_backend = "mp"
            result["config_without_ray"] = config(args, model, env, result)
    server = UsageContext.OPENAI_API_SERVER
    batch = {}
    for world_size in (1, 2, 4):
        tokens, seqs = EngineArgs.get_batch_defaults(world_size=world_size)
        batch[world_size] = [tokens[server], seqs[server]]
    print(json.dumps({"vllm": vllm.__version__, "cpu_batch_defaults": batch,
                      "results": results}))


main()
