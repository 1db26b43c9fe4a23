"""GGUF checkpoints (llama.cpp's format): config, tensors, tokenizer, read from the file.

Weights are dequantized with the `gguf` package's NumPy kernels, one tensor at a
time, and llama.cpp's conversion conventions undone (the Q/K row permutation of
Llama-family weights, the `+1` folded into Gemma norms), giving the tensors an
HF checkpoint holds. Mapping their names to the module's state is
`models.loader`'s (`GGUF_NAMING`, `load_gguf`), which checks their shapes (from the
metadata, before dequantizing) and fills the module as it does from safetensors.
The tokenizer is transformers' own GGUF tokenizer (byte-level BPE or
SentencePiece), built from metadata read here: transformers' GGUF reader
imports torch, its tokenizer converter does not.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import mmap
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf import quants as gguf_quants
from tqdm import tqdm

from jpaged.models import gemma3, gguf_blocks
from jpaged.models.config import ARCHITECTURES, ModelConfig, MoEConfig, TensorEntry
from jpaged.models.quant import Form


def find_gguf(path: str | Path) -> Path:
    """`path` itself, or the single `.gguf` file in the directory `path`."""
    p = Path(path)
    if p.is_dir():
        found = sorted(p.glob("*.gguf"))
        if len(found) != 1:
            raise FileNotFoundError(f"{p}: expected exactly one .gguf file, found {len(found)}")
        return found[0]
    if not p.is_file():
        raise FileNotFoundError(f"GGUF file not found: {p}")
    return p


@dataclasses.dataclass
class GGUFFile:
    """What a GGUF file holds, read: the tensors on demand."""

    config: ModelConfig
    tensors: Iterator[TensorEntry]  # llama.cpp's names, the shapes an HF checkpoint has
    # transformers.PreTrainedTokenizerFast, built on a thread of its own (`read`)
    tokenizer: Future[Any]
    generation_config: dict
    source: str  # the file
    # quantized tensor name -> how it is held (`quantized=True` only)
    layouts: dict[str, Form] = dataclasses.field(default_factory=dict)


class Reader(GGUFReader):
    """gguf's reader over a plain array view of the file's map. Its parser slices the map a
    few times per metadata element (Gemma 3's 262k-token vocabulary: millions of slices),
    and an `np.memmap`'s Python-level `__getitem__` / `__array_finalize__` on each made
    reading that file's metadata 3.4x slower (9.8 vs 2.9 s). The view keeps the map alive."""

    @property  # type: ignore[override]
    def data(self) -> np.ndarray:
        return self._data

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._data = value.view(np.ndarray)

    def _get_field_parts(
        self, orig_offs: int, raw_type: int
    ) -> tuple[int, list[np.ndarray], list[int], list[GGUFValueType]]:
        """gguf's, but an array of scalars read as one part and an array of strings in one
        pass: element by element (several array views and a recursive call each) an 8B
        file's 128k tokens, scores, types and 280k merges took ~7 s to parse."""
        head = self._get(orig_offs, np.uint32)  # the element type
        if (
            raw_type != GGUFValueType.ARRAY
            or self.byte_order != "I"  # a byte-swapped file: gguf's own parse
            or head[0] == GGUFValueType.ARRAY
        ):
            return super()._get_field_parts(orig_offs, raw_type)
        alen = self._get(orig_offs + 4, np.uint64)
        itype, n, offs = GGUFValueType(head[0]), int(alen[0]), orig_offs + 12
        if n == 0:
            return 12, [head, alen], [], [GGUFValueType.ARRAY]
        types = [GGUFValueType.ARRAY, itype]
        nptype = self.gguf_scalar_to_np.get(itype)
        if nptype is not None:
            values = self._get(offs, nptype, n)
            # `ReaderField.contents()` flattens the data parts: one part holds them all
            return 12 + int(values.nbytes), [head, alen, values], [2], types
        if itype != GGUFValueType.STRING:
            raise ValueError(f"Unknown/unhandled field type {itype}")
        data = self._data
        raw = data.data  # a memoryview: int.from_bytes of its slices, no array made
        strings = []
        for _ in range(n):
            length = int.from_bytes(raw[offs : offs + 8], "little")
            strings.append(data[offs + 8 : offs + 8 + length])
            offs += 8 + length
        return offs - orig_offs, [head, alen, *strings], list(range(2, 2 + n)), types


def read(path: str | Path, quantized: bool = False) -> GGUFFile:
    """The GGUF file `path` (or the single one in the directory `path`). `quantized`: its
    quantized matrices read as blocks (`gguf_blocks.Encoded`, or `Blocks` requantized:
    `layouts`), not dequantized."""
    file = find_gguf(path)
    try:
        reader = Reader(file)
    except Exception as e:  # bad magic, truncated file, ...
        raise ValueError(f"{file}: not a readable GGUF file ({e})") from e
    with _naming(file):
        _check_quant_types(reader)
        config = _build_config(reader)
        _check_tokenizer(reader)
    # Importing transformers and converting the vocabulary is pure Python (a quarter of a 1B
    # file's load, single-threaded): beside the weights' decoding, which runs in C++ with the
    # GIL released, it costs the load ~nothing on a second core.
    tokenizer = _TOKENIZER_THREAD.submit(_build_tokenizer, reader, config.architecture, file)
    generation_config: dict[str, Any] = {
        "bos_token_id": config.bos_token_id,
        "eos_token_id": (
            config.eos_token_ids[0]
            if len(config.eos_token_ids) == 1
            else list(config.eos_token_ids)
        ),
        "pad_token_id": _meta(reader, "tokenizer.ggml.padding_token_id"),
    }
    layouts = {
        t.name: layout
        for t in reader.tensors
        # (3-D: a mixture's experts stacked, `ffn_*_exps`)
        if quantized and len(t.shape) in (2, 3) and (layout := gguf_blocks.layout(t.tensor_type))
    }
    return GGUFFile(
        config=config,
        tensors=_tensors(reader, config, str(file), set(layouts)),
        tokenizer=tokenizer,
        generation_config={k: v for k, v in generation_config.items() if v is not None},
        source=str(file),
        layouts=layouts,
    )


# ---------------------------------------------------------------- metadata


def _meta(reader: GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return default
    value = field.contents()
    # GGUF stores hyperparameters as float32: 1e-5 would come back 9.99999974e-06.
    # The shortest float32 repr recovers the decimal the converter was given.
    if isinstance(value, float):
        return float(str(np.float32(value)))
    return value


def _require(reader: GGUFReader, key: str) -> Any:
    value = _meta(reader, key)
    if value is None:
        raise KeyError(f"missing metadata key {key!r}")
    return value


def _uniform(value: Any, key: str) -> int:
    """Per-layer arrays (some converters write them) must be uniform here."""
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise ValueError(f"per-layer values of {key!r} differ ({value}); unsupported")
        value = value[0]
    return int(value)


def _build_config(reader: GGUFReader) -> ModelConfig:
    arch = _require(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"unsupported GGUF architecture {arch!r}; supported: {', '.join(ARCHITECTURES)}"
        )

    def key(name: str, default: Any = None) -> Any:
        return _meta(reader, f"{arch}.{name}", default)

    def req(name: str) -> Any:
        return _require(reader, f"{arch}.{name}")

    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise KeyError("missing tensor 'token_embd.weight'")
    hidden = int(req("embedding_length"))
    num_layers = int(req("block_count"))
    num_heads = _uniform(req("attention.head_count"), f"{arch}.attention.head_count")
    num_kv_heads = _uniform(
        key("attention.head_count_kv", num_heads), f"{arch}.attention.head_count_kv"
    )
    head_dim = int(key("attention.key_length") or key("rope.dimension_count") or 0) or (
        hidden // num_heads
    )
    rope_theta = float(key("rope.freq_base", 10000.0))
    eos = [_meta(reader, f"tokenizer.ggml.{name}_token_id") for name in ("eos", "eot", "eom")]
    common: dict[str, Any] = dict(
        architecture=arch,
        vocab_size=int(tensors["token_embd.weight"].shape[1]),  # GGUF shapes are reversed
        hidden_size=hidden,
        intermediate_size=_uniform(
            key("feed_forward_length", 0) if arch == "qwen3moe" else req("feed_forward_length"),
            f"{arch}.feed_forward_length",
        ),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(req("attention.layer_norm_rms_epsilon")),
        rope_theta=rope_theta,
        rope_scaling=_rope_scaling(reader, arch, head_dim, rope_theta, tensors),
        max_position_embeddings=int(key("context_length", 8192)),
        # llama.cpp writes `output.weight` only when it differs from the embedding
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        final_logit_softcapping=key("final_logit_softcapping"),
        attn_logit_softcapping=key("attn_logit_softcapping"),
        bos_token_id=_meta(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos if e is not None)),
    )
    scale = key("attention.scale")
    if scale:
        common["query_pre_attn_scalar"] = float(scale) ** -2
    if arch in ("qwen3", "qwen3moe"):
        common["qk_norm"] = True
    if arch == "qwen3moe":  # every layer's MLP the experts; llama.cpp always renormalises
        common["moe"] = MoEConfig(
            num_experts=int(req("expert_count")),
            top_k=int(req("expert_used_count")),
            intermediate_size=int(req("expert_feed_forward_length")),
            norm_topk_prob=True,
            sparse_layers=(True,) * num_layers,
        )
    elif arch == "gemma3":
        window = key("attention.sliding_window")
        pattern = key("attention.sliding_window_pattern", 6)
        if isinstance(pattern, list):  # one flag per layer, True = sliding
            sliding = tuple(bool(p) for p in pattern)
        else:  # llama.cpp's Gemma 3 default: every 6th layer is global
            sliding = tuple((i + 1) % int(pattern) != 0 for i in range(num_layers))
        if scale is None:
            # What llama.cpp assumes (the file does not say): head_dim, except the
            # 62-layer 27B model which scales by hidden / heads.
            common["query_pre_attn_scalar"] = float(
                hidden // num_heads if num_layers == 62 else head_dim
            )
        # Gemma 3's own generation_config (and llama.cpp's end-of-generation set) also
        # stops on <end_of_turn>, which files rarely name as eot_token_id.
        tokens = _meta(reader, "tokenizer.ggml.tokens") or []
        if "<end_of_turn>" in tokens:
            eos_ids = (*common["eos_token_ids"], tokens.index("<end_of_turn>"))
            common["eos_token_ids"] = tuple(dict.fromkeys(eos_ids))
        common.update(
            hidden_act="gelu_pytorch_tanh",
            qk_norm=True,
            norm_plus_one=True,
            embed_scale=True,
            sandwich_norm=True,
            sliding_window=int(window) if window else None,
            sliding_layers=sliding if window else (),
            rope_local_base_freq=float(key("rope.freq_base_swa", 10000.0)),
        )
    return ModelConfig(**common)


def _rope_scaling(
    reader: GGUFReader, arch: str, head_dim: int, theta: float, tensors: dict[str, Any]
) -> tuple | None:
    kind = _meta(reader, f"{arch}.rope.scaling.type")
    if "rope_freqs.weight" in tensors:
        # llama.cpp stores Llama 3 scaling only as per-frequency factors.
        factors = _dequantize(tensors["rope_freqs.weight"]).reshape(-1).astype(np.float64)
        dims = int(_meta(reader, f"{arch}.rope.dimension_count") or head_dim)
        return _llama3_from_factors(factors, dims, theta)
    if kind in (None, "none"):
        return None
    if kind == "linear":
        return ("linear", float(_require(reader, f"{arch}.rope.scaling.factor")))
    raise ValueError(f"unsupported rope scaling type {kind!r} (supported: linear, llama3)")


def _llama3_freq_factors(
    dims: int, theta: float, factor: float, low: float, high: float, old_ctx: float
) -> np.ndarray:
    """llama.cpp's `rope_freqs` for Llama 3 scaling (convert_hf_to_gguf.py)."""
    freqs = 1.0 / theta ** (np.arange(0, dims, 2, dtype=np.float64) / dims)
    wavelen = 2 * math.pi / freqs
    smooth = (old_ctx / wavelen - low) / (high - low)
    mid = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < old_ctx / high, 1.0, np.where(wavelen > old_ctx / low, factor, mid))


def _llama3_from_factors(factors: np.ndarray, dims: int, theta: float) -> tuple:
    """Invert `_llama3_freq_factors`.

    The factors depend on (low, high, original context) only through their
    ratios, so the context is fixed at Llama 3's 8192 and the two freq factors
    are solved from the smooth (in-between) region, then checked.
    """
    factor = float(factors.max())
    old_ctx = 8192.0
    low, high = 1.0, 4.0  # Llama 3.1/3.2's values; kept when they reproduce the tensor
    freqs = 1.0 / theta ** (np.arange(0, dims, 2, dtype=np.float64) / dims)
    mid = (factors > 1 + 1e-6) & (factors < factor - 1e-6 * factor)
    if mid.sum() >= 2 and factor > 1:
        # smooth = (old_ctx * freq / 2pi - low) / (high - low) is linear in freq
        smooth = (1 / factors[mid] - 1 / factor) / (1 - 1 / factor)
        slope, intercept = np.polyfit(freqs[mid] / (2 * math.pi), smooth, 1)
        fitted_low = -intercept * old_ctx / slope
        fitted_high = fitted_low + old_ctx / slope
        if not np.allclose((fitted_low, fitted_high), (low, high), rtol=1e-4):
            low, high = float(fitted_low), float(fitted_high)
    rebuilt = _llama3_freq_factors(dims, theta, factor, low, high, old_ctx)
    if rebuilt.shape != factors.shape or not np.allclose(rebuilt, factors, rtol=1e-4):
        raise ValueError("rope_freqs.weight does not match Llama 3 rope scaling; unsupported")
    return ("llama3", factor, low, high, int(old_ctx))


# ----------------------------------------------------------------- weights


def _dequantize(tensor: Any) -> np.ndarray:
    """float32 in PyTorch's `[out, in]` order (GGUF lists dimensions innermost first)."""
    out = gguf_quants.dequantize(tensor.data, tensor.tensor_type)
    return np.asarray(out, dtype=np.float32).reshape(_shape(tensor))


def _shape(tensor: Any) -> tuple[int, ...]:
    return tuple(int(d) for d in reversed(tensor.shape))


@functools.cache
def _supported_qtype(qtype: GGMLQuantizationType) -> bool:
    """Whether the `gguf` package can dequantize `qtype` in NumPy: asked of one zero block."""
    if qtype not in GGML_QUANT_SIZES:
        return False
    try:
        gguf_quants.dequantize(np.zeros(GGML_QUANT_SIZES[qtype][1], np.uint8), qtype)
    except NotImplementedError:
        return False
    return True


def _check_quant_types(reader: GGUFReader) -> None:
    """Before anything is dequantized."""
    for t in reader.tensors:
        if not _supported_qtype(t.tensor_type):
            raise ValueError(
                f"tensor {t.name!r} has unsupported GGUF quantization type {t.tensor_type.name}"
            )


def _raw(tensor: Any, file: str) -> np.ndarray:
    """A tensor's bytes, in a mapping of its own part of `file` (filled at once from the page
    cache: no copy) that is unmapped when the last array reading it goes. Not the reader's
    mapping of the whole file: pages touched through it count as the process's memory until
    it is unmapped, so a model read that way would peak at its file's size on top of what
    it holds."""
    start = tensor.data_offset - tensor.data_offset % mmap.ALLOCATIONGRANULARITY
    with open(file, "rb") as f:
        mapped = mmap.mmap(
            f.fileno(),
            tensor.data_offset - start + tensor.n_bytes,
            flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
            prot=mmap.PROT_READ,
            offset=start,
        )
    return np.frombuffer(mapped, np.uint8, tensor.n_bytes, tensor.data_offset - start)


def _read(
    tensor: Any, c: ModelConfig, quantized: bool, file: str
) -> np.ndarray | gguf_blocks.Blocks | gguf_blocks.Encoded:
    """A tensor as the HF checkpoint holds it, llama.cpp's conversions undone: float32, or
    `quantized` its blocks (an exact type's as they lie, decoded where the loader writes
    them; the rows permuted alike: sub-blocks lie along rows)."""
    name = tensor.name
    stem = name.rsplit(".", 1)[0].rsplit(".", 1)[-1]  # blk.3.attn_q.weight -> attn_q
    # llama.cpp interleaves the rotary halves of a Llama's Q/K rows
    heads = {"attn_q": c.num_heads, "attn_k": c.num_kv_heads}.get(stem)
    heads = heads if c.architecture == "llama" else None
    if quantized:
        shape = _shape(tensor)
        qtype = tensor.tensor_type
        # the rows put back in order as the blocks are decoded (no copy of the file's bytes);
        # experts [E, out, in] their rows' blocks, as one matrix's
        w: Any = gguf_blocks.Encoded(_raw(tensor, file), qtype, shape, heads or 0)
        if qtype not in gguf_blocks.EXACT:
            w = w.blocks()
    else:
        w = _dequantize(tensor)
        if heads is not None:
            w = gguf_blocks.unpermute(w, heads)
    if c.norm_plus_one and name.endswith("norm.weight"):
        w = w - 1.0  # llama.cpp folds Gemma's (1 + w) into the file (norms are never quantized)
    return w


def _tensors(
    reader: GGUFReader, c: ModelConfig, file: str, quantized: set[str]
) -> Iterator[TensorEntry]:
    """`loader.assemble`'s input: shapes from the metadata, reads on demand."""
    total = sum(int(t.n_bytes) for t in reader.tensors)
    # on a terminal only (disable=None): a log or a pipe gets no bar
    with tqdm(total=total, unit="B", unit_scale=True, desc=Path(file).name, disable=None) as bar:
        for t in reader.tensors:
            read = functools.partial(_read, t, c, t.name in quantized, file)
            yield t.name, file, _shape(t), read
            bar.update(int(t.n_bytes))


# --------------------------------------------------------------- tokenizer


# tokenizer.ggml.model -> what it is; transformers builds more (t5, gemma4), none of
# them a vocabulary of an architecture jpaged runs.
TOKENIZERS = {"gpt2": "byte-level BPE", "llama": "SentencePiece BPE with byte fallback"}


_TOKENIZER_THREAD = ThreadPoolExecutor(1, thread_name_prefix="gguf-tokenizer")


def _check_tokenizer(reader: GGUFReader) -> None:
    model = _meta(reader, "tokenizer.ggml.model")
    if model not in TOKENIZERS:
        supported = ", ".join(f"{k!r} ({v})" for k, v in TOKENIZERS.items())
        raise ValueError(
            f"unsupported GGUF tokenizer {model!r} (tokenizer.ggml.model); supported: {supported}"
        )


def _build_tokenizer(reader: GGUFReader, arch: str, file: Path) -> Any:
    with _naming(file):
        return _tokenizer(reader, arch)


@contextlib.contextmanager
def _naming(file: Path) -> Iterator[None]:
    """A KeyError or ValueError raised inside, raised as a ValueError naming `file`."""
    try:
        yield
    except (KeyError, ValueError) as e:
        raise ValueError(f"{file}: {e.args[0] if e.args else e}") from e


def _tokenizer(reader: GGUFReader, arch: str) -> Any:
    """transformers' own GGUF tokenizer, fed from the `gguf` reader.

    `get_gguf_tokenizer` (transformers' entry point) reads the file with a torch-based
    reader; its converter, used here, needs only `tokenizers`. The metadata it gets is
    gathered exactly as `get_gguf_tokenizer` gathers it.
    """
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        GGUF_TOKENIZER_MAPPING,
        convert_gguf_tokenizer,
    )

    model = _meta(reader, "tokenizer.ggml.model")
    tokenizer, config = (
        {
            name: reader.fields[f"tokenizer.{key}"].contents()
            for key, name in renames.items()
            if f"tokenizer.{key}" in reader.fields
        }
        for renames in GGUF_TOKENIZER_MAPPING.values()
    )
    if model == "llama":  # llama.cpp adds BOS to a SentencePiece vocabulary unless told not to
        config.setdefault("add_bos_token", True)
    for name in ("bos", "eos", "unk", "pad"):
        idx = tokenizer.get(f"{name}_token_id")
        if idx is not None:
            config[f"{name}_token"] = tokenizer["tokens"][idx]
    if "chat_template" not in config and arch == "gemma3":
        config["chat_template"] = gemma3.CHAT_TEMPLATE
    backend, extra = convert_gguf_tokenizer(arch, tokenizer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **config, **extra)
