"""`tensorfleet sim`: run the engine simulator where vLLM would run.

The worker launcher execs it in `engine.kind: simulator` pods with vLLM-style
flags and appends the user's `engine.args`, so flags it does not know are
ignored (and logged once) instead of failing the pod.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Sequence
from typing import Any

from tensorfleet import argtypes, contract, extras, vllm_defaults
from tensorfleet.sim.profile import DEFAULT_ACCELERATOR, DEFAULT_KV_CACHE_TOKENS, DEFAULT_MAX_MODEL_LEN, DEFAULT_MODEL

log = logging.getLogger("tensorfleet.sim")


def _lenient(parser: argparse.ArgumentParser) -> None:
    """Make PARSER keep unknown flags in `ignored_args` instead of erroring.

    argparse's subcommand action hands unknown strings to the top-level parser,
    which rejects them; answering "all known" here keeps them ours.
    """
    base = type(parser)

    class Lenient(base):  # type: ignore[valid-type, misc]  # a dynamic base: keeps the parser's own class
        def parse_known_args(self, args: Sequence[str] | None = None,
                             namespace: argparse.Namespace | None = None) -> tuple[argparse.Namespace, list[str]]:
            parsed, extra = super().parse_known_args(args, namespace)
            parsed.ignored_args = [*getattr(parsed, "ignored_args", []), *extra]
            return parsed, []

    parser.__class__ = Lenient




def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "sim", allow_abbrev=False,
        help="run the vLLM-compatible engine simulator (no GPU)",
        description="Serve vLLM's OpenAI API and /metrics from a simulated engine whose capacity is what its flags "
                    "say (in a pod, the operator's plan) and whose timing comes from the catalog's model and GPU facts. "
                    "Unknown vLLM flags are accepted and ignored.",
    )
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=contract.ENGINE_PORT)
    parser.add_argument("--served-model-name", required=True, help="the OpenAI `model` name to answer to")
    parser.add_argument("--model", help=f"Hugging Face id of the simulated model (default: {DEFAULT_MODEL})")
    parser.add_argument("--accelerator", help=f"GPU type, as in spec.accelerator.type (default: {DEFAULT_ACCELERATOR})")
    parser.add_argument("--tensor-parallel-size", type=argtypes.positive_int,
                        help=f"GPUs the model is split over (default: {vllm_defaults.TENSOR_PARALLEL_SIZE})")
    parser.add_argument("--max-model-len", type=argtypes.positive_int,
                        help=f"longest sequence in tokens (default: {DEFAULT_MAX_MODEL_LEN}, or the model's context if shorter)")
    parser.add_argument("--max-num-seqs", type=argtypes.positive_int,
                        help=f"most sequences per step (default: vLLM's, {vllm_defaults.LARGE_GPU_MAX_NUM_SEQS} on GPUs of "
                             f"{vllm_defaults.LARGE_GPU_MIN_MIB // 1024} GiB or more other than A100, else "
                             f"{vllm_defaults.MAX_NUM_SEQS})")
    parser.add_argument("--max-num-batched-tokens", type=argtypes.positive_int,
                        help=f"tokens per step (default: vLLM's, {vllm_defaults.LARGE_GPU_MAX_NUM_BATCHED_TOKENS} or "
                             f"{vllm_defaults.MAX_NUM_BATCHED_TOKENS} by the same rule, at least max-num-seqs)")
    parser.add_argument("--kv-cache-tokens", type=argtypes.positive_int,
                        help=f"KV-cache size in tokens, as the operator plans it (default: {DEFAULT_KV_CACHE_TOKENS})")
    parser.add_argument("--block-size", type=argtypes.positive_int,
                        help=f"tokens per KV-cache block (default: vLLM's, {vllm_defaults.BLOCK_SIZE})")
    parser.add_argument("--startup-delay", type=argtypes.non_negative_float, default=0.0,
                        help="seconds /health answers 503, like a model loading")
    parser.add_argument("--time-scale", type=argtypes.non_negative_float, default=1.0,
                        help="wall-clock seconds per simulated second: 0.01 runs 100x faster, 0 as fast as possible")
    parser.add_argument("--seed", type=int, default=0, help="seed of the generated text and lengths")
    parser.add_argument("--kv-transfer-config", metavar="JSON",
                        help="vLLM's flag: take part in prefill/decode disaggregation, e.g. "
                             "'{\"kv_connector\":\"NixlConnector\",\"kv_role\":\"kv_both\"}' (the side channel "
                             "listens on $VLLM_NIXL_SIDE_CHANNEL_PORT, 5600, and is advertised as "
                             "$VLLM_NIXL_SIDE_CHANNEL_HOST; held KV is freed after $VLLM_NIXL_ABORT_REQUEST_TIMEOUT, "
                             "480 s)")
    parser.add_argument("--kv-transfer-gbps", type=argtypes.positive_float, default=100.0,
                        help="the link each GPU reads another engine's KV over, in Gbit/s (default: 100)")
    lora = parser.add_argument_group("LoRA adapters (vLLM's flags; sim/lora.py)")
    lora.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters by name as the OpenAI model")
    lora.add_argument("--max-loras", type=argtypes.positive_int, default=1,
                      help="adapters in one batch, each in a GPU slot (default: 1)")
    lora.add_argument("--max-lora-rank", type=argtypes.positive_int, default=16, help="largest adapter rank (default: 16)")
    lora.add_argument("--max-cpu-loras", type=argtypes.positive_int,
                      help="adapters kept in the CPU cache (default: --max-loras)")
    lora.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                      help="adapters served from the start: name=path, or JSON {\"name\": ..., \"path\": ...}")
    lora.add_argument("--lora-load-seconds", type=argtypes.non_negative_float, default=0.1,
                      help="simulated seconds to read an adapter from disk into a GPU slot (default: 0.1)")
    lora.add_argument("--lora-swap-seconds", type=argtypes.non_negative_float, default=0.005,
                      help="simulated seconds to bring a cached adapter from CPU memory into a GPU slot (default: "
                           "0.005)")
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    parser.set_defaults(func=run)
    _lenient(parser)


def run(args: argparse.Namespace) -> int:
    extras.require("tensorfleet sim", "sim")
    from aiohttp import web
    from prometheus_client import disable_created_metrics

    from tensorfleet.api import SpecError
    from tensorfleet.httpapi import run_server, setup_logging
    from tensorfleet.sim.kvtransfer import TransferConfigError, parse_config
    from tensorfleet.sim.lora import RUNTIME_UPDATING_ENV, LoraConfig, LoraError, LoraState, parse_module
    from tensorfleet.sim.profile import resilient_profile
    from tensorfleet.sim.server import SimConfig, SimServer

    setup_logging(args.log_level)
    # `_created` samples double the series and no dashboard reads them.
    disable_created_metrics()
    ignored = getattr(args, "ignored_args", [])
    if ignored:
        log.warning("ignoring engine flags the simulator does not model: %s", " ".join(ignored))
    try:
        profile = resilient_profile(
            args.model, args.accelerator, tensor=args.tensor_parallel_size, max_model_len=args.max_model_len,
            max_num_seqs=args.max_num_seqs, kv_cache_tokens=args.kv_cache_tokens,
            max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
        )
    except SpecError as exc:
        raise SystemExit(f"error: {exc}") from None
    log.info("profile: %s", profile.describe())
    transfer = None
    if args.kv_transfer_config:
        try:
            transfer = parse_config(args.kv_transfer_config, listen_host=args.host, link_gbps=args.kv_transfer_gbps)
        except TransferConfigError as exc:
            raise SystemExit(f"error: {exc}") from None
        log.info("KV transfer: %s as %s, side channel %s:%d", transfer.connector, transfer.role,
                 transfer.side_channel_host, transfer.side_channel_port)
    lora: LoraConfig | None = None
    modules: tuple[tuple[str, str], ...] = ()
    if args.enable_lora:
        lora = LoraConfig(max_loras=args.max_loras, max_rank=args.max_lora_rank,
                          max_cpu_loras=max(args.max_cpu_loras or args.max_loras, args.max_loras),
                          load_seconds=args.lora_load_seconds, swap_seconds=args.lora_swap_seconds)
        try:
            modules = tuple(parse_module(text) for text in args.lora_modules)
            check = LoraState(lora, args.served_model_name)  # the same checks the server makes, before it starts
            for name, path in modules:
                check.add(name, path)
        except LoraError as exc:
            raise SystemExit(f"error: --lora-modules: {exc}") from None
    elif args.lora_modules:
        raise SystemExit("error: --lora-modules needs --enable-lora")
    server = SimServer(profile, SimConfig(
        served_model_name=args.served_model_name, model=args.model or profile.model,
        startup_delay=args.startup_delay, time_scale=args.time_scale, seed=args.seed,
        kv_transfer=transfer, bind_host=args.host, lora=lora, lora_modules=modules,
        runtime_lora_updating=os.environ.get(RUNTIME_UPDATING_ENV, "").strip().lower() in ("1", "true"),
    ))

    async def make_app() -> web.Application:
        return server.app()

    return run_server(make_app, args.host, args.port, f"simulator {args.served_model_name!r}")
