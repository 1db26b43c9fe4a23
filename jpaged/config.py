"""EngineConfig: every engine knob, validated once, with the sizes derived from it."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from jpaged.dtypes import DTYPE_NAMES, KV_CACHE_DTYPES, concrete_dtype

BACKENDS = ("paged", "contiguous")
ATTENTION_IMPLS = ("auto", "xla", "pallas")
# "auto": a GGUF's quantized matrices stay quantized on the device ("gguf"), a
# safetensors checkpoint loads float ("none"); "none" dequantizes a GGUF as it loads;
# "int8" quantizes every matrix of either to int8 per output channel as it loads, "fp8"
# likewise to float8_e4m3 codes (made for GPUs that convert fp8 natively: Hopper, Ada).
QUANTIZATIONS = ("auto", "gguf", "int8", "fp8", "none")
# what a quantized matmul multiplies its weights with (`models.load`'s `activations`)
ACTIVATIONS = ("float", "int8")
# Speculative decoding's draft methods (`jpaged.engine.speculative`)
SPECULATIVE_METHODS = ("ngram",)
# No drafts while more sequences run than this (by default): past a few sequences a step
# no longer costs about the same with k more tokens a sequence (on a CPU at least).
DISABLE_BY_BATCH_SIZE = 4
# LoRA adapters (`jpaged.engine.lora`): the keys of `EngineConfig.lora` and their defaults
# (max_cpu_loras None: max_loras, vLLM's default)
LORA_DEFAULTS: dict[str, int | None] = {"max_loras": 1, "max_lora_rank": 16, "max_cpu_loras": None}


def validate_speculative(spec: Any) -> dict[str, Any]:
    """The speculative config with its defaults filled in (vLLM's: unset lookup bounds are
    each other's, or both 5); ValueError naming the field."""
    if not isinstance(spec, dict):
        raise ValueError(f"EngineConfig.speculative must be None or a dict, got {spec!r}")
    known = {
        "method",
        "num_speculative_tokens",
        "prompt_lookup_min",
        "prompt_lookup_max",
        "disable_by_batch_size",
    }
    for key in spec:
        if key not in known:
            raise ValueError(
                f"EngineConfig.speculative.{key}: unknown key (known: {sorted(known)})"
            )
    out = dict(spec)
    if out.get("method", "ngram") not in SPECULATIVE_METHODS:
        raise ValueError(
            f"EngineConfig.speculative.method must be one of {SPECULATIVE_METHODS}, "
            f"got {out['method']!r}"
        )
    out["method"] = "ngram"
    if "num_speculative_tokens" not in out:
        raise ValueError("EngineConfig.speculative.num_speculative_tokens is required")
    for key in (
        "num_speculative_tokens",
        "prompt_lookup_min",
        "prompt_lookup_max",
        "disable_by_batch_size",
    ):
        v = out.get(key, 1)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"EngineConfig.speculative.{key} must be an int >= 1, got {v!r}")
    lo, hi = out.get("prompt_lookup_min"), out.get("prompt_lookup_max")
    out["prompt_lookup_min"] = lo if lo is not None else (hi if hi is not None else 5)
    out["prompt_lookup_max"] = hi if hi is not None else out["prompt_lookup_min"]
    out.setdefault("disable_by_batch_size", DISABLE_BY_BATCH_SIZE)
    if out["prompt_lookup_min"] > out["prompt_lookup_max"]:
        raise ValueError(
            f"EngineConfig.speculative.prompt_lookup_min "
            f"({out['prompt_lookup_min']}) must not exceed prompt_lookup_max "
            f"({out['prompt_lookup_max']})"
        )
    return out


def validate_lora(spec: dict | None) -> dict | None:
    """`EngineConfig.lora` with its defaults filled in: None (LoRA off) or
    {"max_loras": N, "max_lora_rank": R, "max_cpu_loras": C}."""
    if spec is None:
        return None
    if not isinstance(spec, dict):
        raise ValueError(f"EngineConfig.lora must be None or a dict, got {spec!r}")
    out = {**LORA_DEFAULTS, **{k: v for k, v in spec.items() if v is not None}}
    if out["max_cpu_loras"] is None:
        out["max_cpu_loras"] = out["max_loras"]
    for key, value in out.items():
        if key not in LORA_DEFAULTS:
            raise ValueError(
                f"EngineConfig.lora.{key}: unknown key (known: {sorted(LORA_DEFAULTS)})"
            )
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"EngineConfig.lora.{key} must be a positive int, got {value!r}")
    if out["max_cpu_loras"] < out["max_loras"]:  # (vLLM's rule)
        raise ValueError(
            f"EngineConfig.lora.max_cpu_loras ({out['max_cpu_loras']}) must be at least "
            f"max_loras ({out['max_loras']})"
        )
    return out


@dataclasses.dataclass
class EngineConfig:
    backend: str = "paged"
    block_size: int = 16
    # KV memory: give at most one of these three; by default the paged pool gets exactly
    # the bytes the contiguous backend would reserve for max_batch_size x max_seq_len
    # (off a GPU; on one, memory_fraction=0.9).
    num_blocks: int | None = None  # usable blocks, the null block not counted
    kv_memory_bytes: int | None = None
    # Or vLLM's gpu_memory_utilization: the share of a device's memory the engine may use;
    # the pool gets what is left of it after the weights and a step's activations. None:
    # 0.9 on a GPU, the default size elsewhere (`kv_fraction`).
    memory_fraction: float | None = None
    max_batch_size: int = 16  # compute budget: sequences decoded per step
    max_seq_len: int = 2048
    max_waiting_requests: int = 1024
    # per-step token budget: every running decode, then prompt chunks in what is left
    max_num_batched_tokens: int = 512
    admission_reserve: float = 0.2  # admit prompts into (1 - reserve) of the free blocks
    # Reuse the cached K/V of shared prompt prefixes (paged backend; contiguous has none).
    enable_prefix_caching: bool = True
    # Sliding-window layers (Gemma 3) keep only their window's blocks, in KV groups of
    # their own (`jpaged.cache.groups`; paged backend). False: every layer keeps the whole
    # context in one group, as the contiguous backend does.
    hybrid_kv_cache: bool = True
    # weights and KV; "auto" is resolved in validate() (bfloat16 on a GPU, float32
    # elsewhere), so every later reader sees a concrete name
    dtype: str = "auto"
    # K/V values in a 1-byte type with a scale per token and KV head ("int8",
    # "fp8_e4m3", "fp8_e5m2"), or in `dtype` ("auto")
    kv_cache_dtype: str = "auto"
    # weights held quantized (`QUANTIZATIONS`; applies when the engine loads the model)
    quantization: str = "auto"
    # "int8": the inputs of matmuls with quantized weights rounded to int8 (a scale per 32) and
    # multiplied in integers by the CPU kernels, as llama.cpp does; "float": as they are.
    # Applies when the engine loads the model (`models.load`).
    activations: str = "float"
    attention_impl: str = "auto"
    # Devices one model is split over (Megatron tensor parallelism on a 1-D mesh of the
    # first N of `jax.devices()`); KV memory (num_blocks, kv_memory_bytes) is the mesh's.
    tensor_parallel: int = 1
    # Engine replicas, each on its own `tensor_parallel` devices with its own pool, allocator
    # and scheduler, behind one router (`jpaged.engine.router`); KV memory is per replica.
    data_parallel: int = 1
    seed: int = 0
    warmup: bool = True  # compile every shape bucket before serving
    # Dispatch step N + 1 before reading step N's tokens, so the host's work overlaps the
    # device's; a request that stops may compute one token more (never emitted).
    async_scheduling: bool = True
    # vLLM's former `num_scheduler_steps`: a step whose every row is a plain decode (no
    # prompt waiting or being prefilled, no drafts, grammar, penalties, logprobs nor beams)
    # runs up to this many decode steps in one program, the host's work spread over their
    # tokens. The trade: tokens arrive this many at a time, and a request that arrives
    # meanwhile waits for the call to end. Outputs are the same token for token.
    num_scheduler_steps: int = 1
    # vLLM's: no CUDA graphs on a GPU, every kernel of a step launched on its own
    # (`jpaged.engine.programs.EAGER_OPTIONS` says when that may be faster). CPUs ignore it.
    enforce_eager: bool = False
    # XLA executables persist here across processes, so a restart skips most compilation.
    # JAX's cache settings are the whole process's: None leaves them as they are (a
    # library's user may have their own); the server passes a directory by default.
    compilation_cache_dir: str | None = None
    # Speculative decoding (vLLM's keys): None, or {"method": "ngram",
    # "num_speculative_tokens": k, "prompt_lookup_min": a, "prompt_lookup_max": b}
    # (`jpaged.engine.speculative`); validate() fills the defaults in.
    speculative: dict | None = None
    # LoRA adapters (vLLM's names): None (off), or {"max_loras": N (resident at once),
    # "max_lora_rank": R} (`jpaged.engine.lora`); validate() fills the defaults in.
    lora: dict | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        def positive(name: str) -> None:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"EngineConfig.{name} must be a positive int, got {value!r}")

        if self.backend not in BACKENDS:
            raise ValueError(
                f"EngineConfig.backend must be one of {BACKENDS}, got {self.backend!r}"
            )
        for name in (
            "block_size",
            "max_batch_size",
            "max_seq_len",
            "max_waiting_requests",
            "max_num_batched_tokens",
            "tensor_parallel",
            "data_parallel",
            "num_scheduler_steps",
        ):
            positive(name)
        for name in ("num_blocks", "kv_memory_bytes"):
            if getattr(self, name) is not None:
                positive(name)
        if self.num_blocks is not None and self.kv_memory_bytes is not None:
            raise ValueError("EngineConfig: give num_blocks or kv_memory_bytes, not both")
        sized = self.num_blocks is not None or self.kv_memory_bytes is not None
        if self.memory_fraction is not None:
            if isinstance(self.memory_fraction, bool) or not 0 < self.memory_fraction <= 1:
                raise ValueError(
                    f"EngineConfig.memory_fraction must be in (0, 1], got {self.memory_fraction!r}"
                )
            if sized:
                raise ValueError(
                    "EngineConfig: give memory_fraction or num_blocks/kv_memory_bytes, not both"
                )
        if self.backend == "contiguous" and (sized or self.memory_fraction is not None):
            raise ValueError(
                "EngineConfig.num_blocks/kv_memory_bytes/memory_fraction: the contiguous "
                "backend reserves max_batch_size x max_seq_len; set those instead"
            )
        if not 0.0 <= self.admission_reserve < 1.0:
            raise ValueError(
                f"EngineConfig.admission_reserve must be in [0, 1), got {self.admission_reserve!r}"
            )
        if self.dtype not in DTYPE_NAMES:
            raise ValueError(
                f"EngineConfig.dtype must be one of {list(DTYPE_NAMES)}, got {self.dtype!r}"
            )
        self.dtype = concrete_dtype(self.dtype)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"EngineConfig.kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, "
                f"got {self.kv_cache_dtype!r}"
            )
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"EngineConfig.quantization must be one of {QUANTIZATIONS}, "
                f"got {self.quantization!r}"
            )
        if self.activations not in ACTIVATIONS:
            raise ValueError(
                f"EngineConfig.activations must be one of {ACTIVATIONS}, got {self.activations!r}"
            )
        if self.attention_impl not in ATTENTION_IMPLS:
            raise ValueError(
                f"EngineConfig.attention_impl must be one of {ATTENTION_IMPLS}, "
                f"got {self.attention_impl!r}"
            )
        if self.attention_impl == "auto":  # resolved here, once: the Pallas kernel on a GPU
            import jax

            self.attention_impl = "pallas" if jax.default_backend() == "gpu" else "xla"
        flags = ("hybrid_kv_cache", "enable_prefix_caching", "async_scheduling", "enforce_eager")
        for flag in flags:
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"EngineConfig.{flag} must be a bool, got {getattr(self, flag)!r}")
        if not isinstance(self.seed, int):
            raise ValueError(f"EngineConfig.seed must be an int, got {self.seed!r}")
        if self.speculative is not None:
            self.speculative = validate_speculative(self.speculative)
        self.lora = validate_lora(self.lora)
        if self.lora is not None and self.data_parallel > 1:
            raise ValueError("EngineConfig.lora: not supported with data_parallel > 1 yet")

    def kv_fraction(self) -> float | None:
        """The memory_fraction in effect: the one given, else 0.9 for a paged pool given no
        size on a GPU (asked when the engine is built: JAX may not start before
        `jax.distributed.initialize`)."""
        if self.memory_fraction is not None or self.backend != "paged":
            return self.memory_fraction
        if self.num_blocks is None and self.kv_memory_bytes is None:
            import jax

            return 0.9 if jax.default_backend() == "gpu" else None
        return None

    @property
    def blocks_per_seq(self) -> int:
        return math.ceil(self.max_seq_len / self.block_size)

    def usable_blocks(self, block_bytes: int, num_groups: int = 1) -> int:
        """Blocks sequences may hold (the null block excluded), each `block_bytes` bytes
        (K and V of one KV group's layers; `num_groups` groups hold every layer)."""
        if self.backend == "contiguous" or (
            self.num_blocks is None and self.kv_memory_bytes is None
        ):
            return self.max_batch_size * self.blocks_per_seq * num_groups
        if self.num_blocks is not None:
            return self.num_blocks
        assert self.kv_memory_bytes is not None
        blocks = self.kv_memory_bytes // block_bytes
        if blocks < 1:
            raise ValueError(
                f"EngineConfig.kv_memory_bytes={self.kv_memory_bytes} holds no block "
                f"({block_bytes} bytes each)"
            )
        return int(blocks)
