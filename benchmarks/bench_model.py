"""The `bench` model: a deterministic ~57M-parameter Llama checkpoint, written once.

    python -m benchmarks.bench_model [--out DIR]     # prints the directory

Throughput does not depend on trained weights, so the benchmark model has random
ones (seeded, O(1) activations) in a real Hugging Face layout: `config.json`,
`generation_config.json`, `model.safetensors` (written with NumPy, no PyTorch),
and a real byte-level BPE `tokenizer.json` with 32000 tokens, trained with
`tokenizers` on a seeded synthetic corpus so every id decodes to text.

Shape: hidden 512, 8 layers, 8 heads / 2 KV heads (head_dim 64), MLP 1536,
vocab 32000, untied LM head: the model of the serving numbers in benchmarks/RESULTS.md.
The checkpoint is cached under `~/.cache/jpaged/bench-model-v1` (`$JPAGED_CACHE`
overrides `~/.cache/jpaged`); a new layout gets a new version suffix.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

VERSION = 1
SEED = 0
CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 512,
    "intermediate_size": 1536,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": 32000,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "torch_dtype": "float32",
}
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>"]  # ids 0 and 1
GENERATION = {"bos_token_id": 0, "eos_token_id": 1}


def cache_root() -> Path:
    return Path(os.environ.get("JPAGED_CACHE", "~/.cache/jpaged")).expanduser()


def default_path() -> Path:
    return cache_root() / f"bench-model-v{VERSION}"


def num_params(config: dict = CONFIG) -> int:
    return sum(int(np.prod(s)) for s in _shapes(config).values())


def _shapes(c: dict) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> PyTorch-layout shape ([out, in] for linear weights)."""
    h, i, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    q, kv = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (v, h),
        "model.norm.weight": (h,),
    }
    if not c["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (v, h)
    for n in range(c["num_hidden_layers"]):
        p = f"model.layers.{n}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "post_attention_layernorm.weight": (h,),
            p + "mlp.gate_proj.weight": (i, h),
            p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
        }
    return shapes


def random_weights(config: dict = CONFIG, seed: int = SEED) -> dict[str, np.ndarray]:
    """Seeded float32 weights with O(1) activations: N(0, 1) embeddings, N(0, 1/fan_in)
    linear weights, norms 1 + N(0, 0.1)."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in _shapes(config).items():
        w = rng.standard_normal(shape, dtype=np.float32)
        if len(shape) == 1:
            w = 1.0 + 0.1 * w
        elif "embed" not in name:
            w *= np.float32(shape[1] ** -0.5)
        out[name] = w
    return out


VOWELS = ["a", "e", "i", "o", "u", "y", "ai", "ea", "ou"]


def _corpus(seed: int, num_words: int = 400_000, lexicon: int = 120_000) -> list[str]:
    """Seeded pseudo-English: Zipf-distributed words built from syllables, some
    capitalised and punctuated, so BPE has enough distinct pairs for 32000 tokens."""
    rng = np.random.default_rng(seed)
    onsets = "b c d f g h j k l m n p r s t v w z bl br ch cl cr dr fl fr gr pl pr sh st th tr"
    syllables = [o + v for o in onsets.split() for v in VOWELS]
    codas = ["", "", "n", "s", "t", "r", "l", "ng", "st", "nd"]
    lengths = rng.integers(1, 5, lexicon)
    words = []
    for n in lengths:
        parts = rng.choice(len(syllables), n)
        words.append("".join(syllables[p] for p in parts) + codas[rng.integers(len(codas))])
    ranks = np.minimum(rng.zipf(1.15, num_words), lexicon) - 1
    text = []
    for k, r in enumerate(ranks.tolist()):
        w = words[r]
        if k % 11 == 0:
            w = w.capitalize()
        if k % 13 == 12:
            w += rng.choice([".", ",", "!", "?", ";", ":"])
        if k % 97 == 0:
            w = str(int(rng.integers(0, 100_000)))
        text.append(w)
    return [" ".join(text[i : i + 64]) for i in range(0, len(text), 64)]


def build_tokenizer(path: Path, vocab_size: int, seed: int = SEED) -> None:
    """A byte-level BPE (any text encodes, every id decodes) of exactly `vocab_size` ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=1,
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(
            f"the bench tokenizer has {tok.get_vocab_size()} tokens, expected {vocab_size}"
        )
    bos = SPECIALS[0]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, 0)]
    )
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": SPECIALS[0],
                "eos_token": SPECIALS[1],
                "model_max_length": CONFIG["max_position_embeddings"],
                "clean_up_tokenization_spaces": False,
            },
            indent=2,
        )
    )


def write_checkpoint(path: Path, seed: int = SEED) -> Path:
    from safetensors.numpy import save_file

    path.mkdir(parents=True, exist_ok=True)
    save_file(
        random_weights(CONFIG, seed), str(path / "model.safetensors"), metadata={"format": "pt"}
    )
    (path / "config.json").write_text(json.dumps(CONFIG, indent=2))
    (path / "generation_config.json").write_text(json.dumps(GENERATION, indent=2))
    build_tokenizer(path, CONFIG["vocab_size"], seed)
    return path


def ensure(path: Path | None = None) -> Path:
    """The bench checkpoint directory, written on first use (atomically, by rename)."""
    path = Path(path) if path is not None else default_path()
    if (path / "model.safetensors").exists() and (path / "tokenizer.json").exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    print(
        f"jpaged: writing the bench model ({num_params() / 1e6:.0f}M params) to {path}", flush=True
    )
    return publish(path, write_checkpoint)


def publish(path: Path, write: Callable[[Path], object]) -> Path:
    """Write a checkpoint directory into a temporary sibling, then rename it into place, so
    a crash or a concurrent writer never leaves a half-written `path`."""
    tmp = Path(tempfile.mkdtemp(prefix=path.name + ".", dir=path.parent))
    try:
        write(tmp)
        try:
            tmp.rename(path)
        except OSError:  # another process won the race: keep theirs
            if not (path / "model.safetensors").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def resolve(model: str) -> Path:
    """`bench` -> the cached bench checkpoint; a demo model's name (`models.demo`) -> its
    GGUF; anything else is a path."""
    from jpaged.models import demo

    return ensure() if model == "bench" else demo.resolve(model)[0].resolve()


def fingerprint(path: Path) -> str:
    h = hashlib.sha256()
    for name in ("config.json", "tokenizer.json", "model.safetensors"):
        with open(path / name, "rb") as f:
            while chunk := f.read(1 << 22):
                h.update(chunk)
    return h.hexdigest()[:16]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_model",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--out", type=Path, help="directory (default: the shared cache)")
    p.add_argument("--fingerprint", action="store_true", help="also print a content hash")
    args = p.parse_args(argv)
    path = ensure(args.out)
    print(path)
    if args.fingerprint:
        print(fingerprint(path))


if __name__ == "__main__":
    main()
