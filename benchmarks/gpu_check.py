"""One prepared GPU run: what a lent card's few minutes should measure, in one command.

    python -m benchmarks.gpu_check --out DIR     # on a GPU: ~6 minutes on an H100
    python -m benchmarks.gpu_check --small       # anywhere: tiny shapes (the suite runs it)

Prints, and writes to DIR/gpu_check.md (with `--write`, to RESULTS.md too):
- the card, JAX, and its copy bandwidth (read + write of a 2 GiB array);
- the attention kernel against JAX's own Pallas paged attention and a dense cache
  (`bench_kernel.gpu_table`: µs, GB/s, % of the copy bandwidth);
- the decode step of random-weight Llama-3.2-1B and Llama-3.1-8B geometries in bfloat16
  at 1 / 4 / 64 / 256 users (32-token prompts): the device's time a step (every program
  blocked on), the step as served, and the share of the memory roofline (the weights'
  bytes plus the KV read, over the copy bandwidth, against the device time); at 256 users
  the served output tokens a second;
- the pool scan: the 1B step at 64 users with a 1024- and a 16384-block pool (flat: no
  op of the step touches the whole pool);
- the card's target proto (DIR/target_config.txtpb), for the deviceless compile
  (`benchmarks/gpu_structure.py`).

On a GPU image without the project installed, run it from the checkout with
`PYTHONPATH=.` (../shared/gpu/README.md: the wheels the image lacks).
"""

from __future__ import annotations

import argparse
import datetime
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks import bench_kernel, profile_step
from benchmarks.common import append_results, build_engine, render_table
from benchmarks.gpu_structure import SHAPES
from jpaged.config import EngineConfig
from models import loader
from models.config import LoadedModel, ModelConfig

PROMPT_TOKENS = 32
TINY = ModelConfig(
    architecture="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
    num_heads=4, num_kv_heads=2, head_dim=16,
)  # fmt: skip


def word_tokenizer(vocab: int) -> Any:
    """A tokenizer of `vocab` words `t0 t1 ...`: random weights have no text, but the
    engine detokenizes what it serves."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0")


def random_model(config: ModelConfig, dtype: str) -> LoadedModel:
    """A model of `config`'s geometry with random weights, made on the device."""
    build = loader.MODELS[config.architecture]
    # one program makes every weight (eagerly, each op of the initializers compiles apart)
    module = nnx.jit(lambda: build(config, dtype=jnp.dtype(dtype), rngs=nnx.Rngs(0)))()
    return LoadedModel(module, word_tokenizer(config.vocab_size), {}, "random")


def weight_bytes(model: LoadedModel) -> int:
    """What a decode step reads of the weights (all of them; a tied table once, as the head)."""
    state = nnx.state(model.model)
    return sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(state))


def kv_bytes(c: ModelConfig, users: int, context: int, dtype: str) -> int:
    return (
        2 * c.num_layers * c.num_kv_heads * c.head_dim * users * context * np.dtype(dtype).itemsize
    )


def engine_for(model: LoadedModel, users: int, dtype: str, num_blocks: int | None) -> Any:
    config = EngineConfig(
        max_batch_size=users,
        max_seq_len=PROMPT_TOKENS + 128,
        max_num_batched_tokens=2048,
        dtype=dtype,
        num_blocks=num_blocks,
        enable_prefix_caching=False,
    )
    return build_engine(model, config)


def decode_rows(
    name: str, model: LoadedModel, users: list[int], steps: int, dtype: str, bandwidth: float
) -> list[list[str]]:
    """The decode step at each number of users, on one engine (its programs compiled once)."""
    engine = engine_for(model, max(users), dtype, None)
    weights = weight_bytes(model)
    rows = []
    for n in users:
        start = time.perf_counter()
        r = profile_step.measure(engine, n, steps, PROMPT_TOKENS)
        device, served = r["alone"]["wall_s"], r["served"]["wall_s"]
        read = weights + kv_bytes(model.config, n, PROMPT_TOKENS + steps, dtype)
        rows.append([
            name, str(n), f"{1e3 * device:.2f}", f"{1e3 * served:.2f}",
            f"{read / bandwidth / device:.0%}", f"{n / served:,.0f}",
            f"{time.perf_counter() - start:.0f}",
        ])  # fmt: skip
        print(" | ".join(rows[-1]), flush=True)
    return rows


def pool_scan(model: LoadedModel, users: int, steps: int, dtype: str, pools: list[int]) -> str:
    times = []
    for blocks in pools:
        engine = engine_for(model, users, dtype, blocks)
        times.append(profile_step.measure(engine, users, steps, PROMPT_TOKENS)["alone"]["wall_s"])
    cells = ", ".join(f"{b} blocks {1e3 * t:.2f} ms" for b, t in zip(pools, times, strict=True))
    return f"Pool scan ({users} users, device ms a step): {cells}; ratio {times[-1] / times[0]:.2f}"


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--small", action="store_true", help="tiny shapes: any machine, seconds")
    p.add_argument("--out", type=Path, default=Path("gpu_check"), help="folder of the outputs")
    p.add_argument("--users", default="1,4,64,256")
    p.add_argument("--steps", type=int, default=32, help="decode steps timed per pass")
    p.add_argument("--write", action="store_true", help="append the table to RESULTS.md")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    on_gpu = jax.default_backend() == "gpu"
    dtype = "bfloat16" if on_gpu else "float32"
    users = [int(n) for n in args.users.split(",")]
    devices = ", ".join(sorted({d.device_kind for d in jax.devices()}))
    bandwidth = bench_kernel.copy_bandwidth(1 << 20 if args.small else 2 << 30)
    head = f"{devices}, JAX {jax.__version__}, copy bandwidth {bandwidth / 1e9:.0f} GB/s"
    print(head, flush=True)
    if on_gpu:
        from jax._src.lib import xla_client

        proto = xla_client.get_topology_for_devices(jax.devices()).target_config
        (args.out / "target_config.txtpb").write_text(str(proto))

    if args.small:
        kernel, note = bench_kernel.gpu_table([2], [64], [64], jnp.dtype(dtype), bandwidth)
        geometries = {"tiny": TINY}
        steps, pools = min(args.steps, 4), [64, 256]
    else:
        kernel, note = bench_kernel.gpu_table(
            [1, 64, 256], [512, 4096], [64, 128], jnp.dtype(dtype), bandwidth
        )
        geometries = {"1B": SHAPES["1b"], "8B": SHAPES["8b"]}
        steps, pools = args.steps, [1024, 16384]
    rows = []
    for name, config in geometries.items():
        model = random_model(config, dtype)
        rows += decode_rows(name, model, users, steps, dtype, bandwidth)
        if name in ("tiny", "1B"):
            scan = pool_scan(model, min(64, max(users)), steps, dtype, pools)
            print(scan, flush=True)
        del model
    step_head = ["model", "users", "device ms a step", "served ms a step",
                 "memory roofline", "served tok/s", "s measured"]  # fmt: skip
    text = "\n\n".join([
        f"{datetime.date.today()}: `python -m benchmarks.gpu_check"
        f"{' --small' if args.small else ''}` on {head}",
        "\n".join(kernel), note, render_table(step_head, rows), scan,
    ])  # fmt: skip
    print(f"\n{text}")
    (args.out / "gpu_check.md").write_text(text + "\n")
    if args.write:
        append_results("## One prepared GPU run (issue 50, `benchmarks/gpu_check.py`)", text)
    return text


if __name__ == "__main__":
    main()
