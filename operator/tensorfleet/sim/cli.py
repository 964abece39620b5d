"""`tensorfleet sim`: run the engine simulator where vLLM would run, taking vLLM-style flags and ignoring (and
logging once) those it does not know; `tensorfleet sim calibrate` is a word after `sim`, not an argparse subcommand,
so that unknown flags keep their values. Design: docs/simulator.md#running-where-vllm-runs."""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
from collections.abc import Sequence
from typing import Any

from tensorfleet import argtypes, contract, extras, vllm_defaults
from tensorfleet.sim.profile import (
    DEFAULT_ACCELERATOR,
    DEFAULT_KV_CACHE_TOKENS,
    DEFAULT_MAX_MODEL_LEN,
    DEFAULT_MODEL,
    Profile,
    resilient_profile,
)

log = logging.getLogger("tensorfleet.sim")


def _lenient(parser: argparse.ArgumentParser, words: dict[str, argparse.ArgumentParser] | None = None) -> None:
    """Make PARSER keep unknown flags in `ignored_args` instead of erroring.

    argparse's subcommand action hands unknown strings to the top-level parser,
    which rejects them; answering "all known" here keeps them ours. A first
    argument in WORDS hands the rest to that word's own (strict) parser.
    """
    base = type(parser)

    class Lenient(base):  # type: ignore[valid-type, misc]  # a dynamic base: keeps the parser's own class
        def parse_known_args(self, args: Sequence[str] | None = None,
                             namespace: argparse.Namespace | None = None) -> tuple[argparse.Namespace, list[str]]:
            if args and words and args[0] in words:
                return words[args[0]].parse_args(args[1:], namespace), []
            parsed, extra = super().parse_known_args(args, namespace)
            parsed.ignored_args = [*getattr(parsed, "ignored_args", []), *extra]
            return parsed, []

    parser.__class__ = Lenient




def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "sim", allow_abbrev=False,
        help="run the vLLM-compatible engine simulator (no GPU)",
        description="Serve vLLM's OpenAI API and /metrics from a simulated engine whose capacity is what its flags "
                    "say (in a pod, the operator's plan) and whose timing comes from the catalog's model and GPU facts, "
                    "or from a profile calibrated against a real vLLM (--profile). "
                    "Unknown vLLM flags are accepted and ignored.",
        epilog="`tensorfleet sim calibrate --url URL -o PROFILE.json` measures a running vLLM and writes a profile "
               "for --profile (`tensorfleet sim calibrate --help`).",
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
    parser.add_argument("--profile", metavar="FILE",
                        help="a profile from `tensorfleet sim calibrate`: steps timed by the step time fitted to that "
                             "engine instead of the catalog's roofline, and its capacity (KV blocks and block size, "
                             "max-model-len, max-num-seqs and max-num-batched-tokens when it has them) where no flag "
                             "gives one")
    parser.add_argument("--startup-delay", type=argtypes.non_negative_float, default=0.0,
                        help="seconds /health answers 503, like a model loading")
    parser.add_argument("--time-scale", type=argtypes.non_negative_float, default=1.0,
                        help="wall-clock seconds per simulated second: 0.01 runs 100x faster, 0 as fast as possible")
    parser.add_argument("--seed", type=int, default=0, help="seed of the generated text and lengths")
    parser.add_argument("--stream-interval", type=argtypes.positive_int, default=1,
                        help="vLLM's flag: a streamed choice's first token goes alone, then an event once this many "
                             "tokens are pending (default: 1, an event per engine step)")
    parser.add_argument("--enable-prompt-tokens-details", action="store_true",
                        help="vLLM's flag: answers' usage names the prompt tokens the prefix cache held "
                             "(prompt_tokens_details.cached_tokens)")
    parser.add_argument("--kv-transfer-config", metavar="JSON",
                        help="vLLM's flag: take part in prefill/decode disaggregation, e.g. "
                             "'{\"kv_connector\":\"NixlConnector\",\"kv_role\":\"kv_both\"}' (the side channel "
                             "listens on $VLLM_NIXL_SIDE_CHANNEL_PORT, 5600, and is advertised as "
                             "$VLLM_NIXL_SIDE_CHANNEL_HOST; held KV is freed after $VLLM_NIXL_ABORT_REQUEST_TIMEOUT, "
                             "480 s)")
    parser.add_argument("--kv-events-config", metavar="JSON",
                        help="vLLM's flag: publish the prefix cache's KV events (BlockStored, BlockRemoved) over "
                             "ZeroMQ as vLLM does, e.g. '{\"enable_kv_cache_events\":true,\"publisher\":\"zmq\","
                             "\"endpoint\":\"tcp://*:5557\",\"replay_endpoint\":\"tcp://*:5558\"}' "
                             "(sim/kvevents.py; needs pyzmq and msgspec)")
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
    _lenient(parser, {"calibrate": _calibrate_parser(type(parser), parser.prog)})


def _calibrate_parser(parser_class: type[argparse.ArgumentParser], prog: str) -> argparse.ArgumentParser:
    from tensorfleet.sim.calibrate import Sweep

    default = Sweep()

    def numbers(text: str) -> tuple[int, ...]:
        try:
            values = tuple(int(v) for v in text.split(","))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
        if not values or min(values) < 1:
            raise argparse.ArgumentTypeError(f"{text!r}: every value must be at least 1")
        return values

    def joined(values: tuple[int, ...]) -> str:
        return ",".join(map(str, values))

    parser = parser_class(
        prog=f"{prog} calibrate", allow_abbrev=False,
        description="Measure a running vLLM (GPU or CPU) with a short sweep (prefill at several prompt lengths, "
                    "decode at several batch sizes and contexts, and under a sustained mixed load; a minute or two), "
                    "read its capacity from /metrics "
                    "and /v1/models, fit the simulator's step time to it (step = overhead + a x decode seqs + b x "
                    "prefill tokens + c x context tokens, plus the latency before a request's first step on an idle "
                    "and on a busy engine) and write "
                    "a profile for `tensorfleet sim --profile`. Every request is a stream of random token ids with "
                    "ignore_eos, so lengths are exact.")
    parser.add_argument("--url", required=True, help="the engine, e.g. http://127.0.0.1:8000")
    parser.add_argument("--model", help="the served model to measure (default: the engine's base model)")
    parser.add_argument("-o", "--output", required=True, metavar="PROFILE.json", help="where to write the profile")
    parser.add_argument("--max-num-seqs", type=argtypes.positive_int,
                        help="the engine's --max-num-seqs, to record (vLLM does not publish it; the sweep learns it "
                             "when a batch it sends is larger)")
    parser.add_argument("--max-num-batched-tokens", type=argtypes.positive_int,
                        help="the engine's --max-num-batched-tokens, to record (vLLM does not publish it)")
    parser.add_argument("--api-key", default=os.environ.get("VLLM_API_KEY"),
                        help="the engine's --api-key (default: $VLLM_API_KEY)")
    sweep = parser.add_argument_group("the sweep (sim/calibrate.py)")
    sweep.add_argument("--concurrencies", type=numbers, default=default.concurrencies, metavar="N,N,...",
                       help=f"decode batch sizes (default: {joined(default.concurrencies)}; capped at max-num-seqs)")
    sweep.add_argument("--contexts", type=numbers, default=default.contexts, metavar="N,N,...",
                       help=f"prompt tokens of the decode requests (default: {joined(default.contexts)})")
    sweep.add_argument("--decode-tokens", type=argtypes.positive_int, default=default.decode_tokens,
                       help=f"tokens each decode request generates (default: {default.decode_tokens})")
    sweep.add_argument("--prompt-lengths", type=numbers, default=default.prompt_lengths, metavar="N,N,...",
                       help=f"prefill prompt lengths (default: {joined(default.prompt_lengths)}; capped at "
                            "max-model-len)")
    sweep.add_argument("--prefill-background", type=argtypes.non_negative_int, default=default.prefill_background,
                       metavar="N", help="requests decoding behind a second set of prefill measurements (the TTFT of a "
                                         f"busy engine; 0: none; default: {default.prefill_background})")
    sweep.add_argument("--sustained-seconds", type=argtypes.non_negative_float, default=default.sustained_s,
                       metavar="SECONDS", help="the window of each sustained point: a closed loop at a quarter, half "
                                               "and all of the largest batch, mixed lengths, the engine's own step "
                                               f"count (0: none; default: {default.sustained_s:g})")
    sweep.add_argument("--repeats", type=argtypes.positive_int, default=default.repeats,
                       help=f"samples of each decode point (default: {default.repeats})")
    sweep.add_argument("--prefill-repeats", type=argtypes.positive_int, default=default.prefill_repeats,
                       help=f"samples of each prefill length (default: {default.prefill_repeats})")
    sweep.add_argument("--warmup", type=argtypes.non_negative_int, default=default.warmup,
                       help=f"requests sent first and not measured (default: {default.warmup})")
    sweep.add_argument("--time-limit", type=argtypes.positive_float, default=default.time_limit_s, metavar="SECONDS",
                       help="start no new measurement after this long; fit what was measured "
                            f"(default: {default.time_limit_s:g})")
    sweep.add_argument("--seed", type=int, default=default.seed, help="seed of the prompts' token ids")
    parser.set_defaults(func=calibrate)
    return parser


def calibrate(args: argparse.Namespace) -> int:
    extras.require("tensorfleet sim calibrate", "sim")
    import asyncio

    from tensorfleet.sim.calibrate import CalibrationError, Sweep, parse, write
    from tensorfleet.sim.probe import measure

    sweep = Sweep(concurrencies=args.concurrencies, contexts=args.contexts, decode_tokens=args.decode_tokens,
                  prompt_lengths=args.prompt_lengths, repeats=args.repeats, warmup=args.warmup,
                  prefill_background=args.prefill_background, prefill_repeats=args.prefill_repeats,
                  sustained_s=args.sustained_seconds,
                  time_limit_s=args.time_limit, seed=args.seed)
    try:
        doc = asyncio.run(measure(args.url, args.model, sweep, max_num_seqs=args.max_num_seqs,
                                  max_num_batched_tokens=args.max_num_batched_tokens, api_key=args.api_key,
                                  say=lambda line: print(line, flush=True)))
    except CalibrationError as exc:
        raise SystemExit(f"error: {exc}") from None
    write(args.output, doc)
    fitted = doc["fit"]
    print(f"fit: {parse(doc).step.describe()}; largest error {fitted['max_relative_error']:.1%}, "
          f"mean {fitted['mean_relative_error']:.1%}")
    for note in [*fitted["dropped"], *doc["notes"]]:
        print(f"  {note}")
    print(f"wrote {args.output}")
    return 0


def build_profile(args: argparse.Namespace) -> Profile:
    """The simulated engine's Profile from the flags: the catalog's roofline, or with --profile the calibrated
    step time and the capacity it recorded (flags win over both). SystemExit with one line on a bad input."""
    from tensorfleet.api import SpecError

    capacity = {"tensor": args.tensor_parallel_size, "max_model_len": args.max_model_len,
                "max_num_seqs": args.max_num_seqs, "kv_cache_tokens": args.kv_cache_tokens,
                "max_num_batched_tokens": args.max_num_batched_tokens, "block_size": args.block_size}
    try:
        if args.profile:
            from tensorfleet.sim.calibrate import CalibrationError, load

            try:
                return load(args.profile).profile(args.model, args.accelerator, **capacity)
            except CalibrationError as exc:
                raise SystemExit(f"error: --profile {exc}") from None
        return resilient_profile(args.model, args.accelerator, **capacity)
    except SpecError as exc:
        raise SystemExit(f"error: {exc}") from None


def run(args: argparse.Namespace) -> int:
    extras.require("tensorfleet sim", "sim")
    from aiohttp import web
    from prometheus_client import disable_created_metrics

    from tensorfleet.httpapi import ServerLimits, run_server, setup_logging
    from tensorfleet.sim.kvevents import KVEventsConfigError
    from tensorfleet.sim.kvevents import parse_config as parse_kv_events
    from tensorfleet.sim.kvtransfer import TransferConfigError, parse_config
    from tensorfleet.sim.lora import RUNTIME_UPDATING_ENV, LoraConfig, LoraError, LoraState, parse_module
    from tensorfleet.sim.server import SimConfig, SimServer

    setup_logging(args.log_level)
    # `_created` samples double the series and no dashboard reads them.
    disable_created_metrics()
    ignored = getattr(args, "ignored_args", [])
    if ignored:
        log.warning("ignoring engine flags the simulator does not model: %s", " ".join(ignored))
    profile = build_profile(args)
    log.info("profile: %s", profile.describe())
    transfer = None
    if args.kv_transfer_config:
        try:
            transfer = parse_config(args.kv_transfer_config, listen_host=args.host, link_gbps=args.kv_transfer_gbps)
        except TransferConfigError as exc:
            raise SystemExit(f"error: {exc}") from None
        log.info("KV transfer: %s as %s, side channel %s:%d", transfer.connector, transfer.role,
                 transfer.side_channel_host, transfer.side_channel_port)
    kv_events = None
    if args.kv_events_config:
        try:
            kv_events = parse_kv_events(args.kv_events_config)
        except KVEventsConfigError as exc:
            raise SystemExit(f"error: {exc}") from None
        absent = [m for m in ("zmq", "msgspec") if importlib.util.find_spec(m) is None]
        if kv_events is not None and absent:
            raise SystemExit(f"error: --kv-events-config needs pyzmq and msgspec ({', '.join(absent)} not "
                             "installed): pip install 'tensorfleet[sim]'")
        if kv_events is not None:
            log.info("KV events: published on %s, replay on %s", kv_events.endpoint, kv_events.replay_endpoint)
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
        prompt_tokens_details=args.enable_prompt_tokens_details,
        stream_interval=args.stream_interval, kv_events=kv_events,
    ))

    async def make_app() -> web.Application:
        return server.app()

    # Idle keep-alive connections close when vLLM's do, so its clients meet the same server.
    return run_server(make_app, args.host, args.port, f"simulator {args.served_model_name!r}",
                      limits=ServerLimits(idle_timeout=contract.ENGINE_KEEP_ALIVE_S))
