"""`python tests/integration/multiprocess_generate.py CHECKPOINT COORDINATOR PROCESSES ID`:
one process of a model split over every process's devices (test_multiprocess.py starts
them). Process 0 generates test_multiprocess's workload and prints its token ids as JSON;
the others mirror it and exit when it does."""

from __future__ import annotations

import json
import sys
import tracemalloc

from jpaged.engine import distributed

PROMPTS = [[5, 17, 99, 3], list(range(30, 43)), [40, 41, 42, 43, 44, 45, 46, 47, 9], [200, 7]]
LATER = [40, 41, 42, 43, 44, 45, 46, 47, 60, 61]  # after the others: a prefix-cache hit
ENGINE = dict(
    dtype="float32",
    block_size=4,
    max_seq_len=64,
    max_batch_size=4,
    max_num_batched_tokens=8,
    warmup=False,
    compilation_cache_dir=None,
)


def workload() -> tuple[list, list]:
    """The prompts and their sampling: greedy, one sampled with a seed (every logit
    counts), one with penalties and a logit bias (the sampler's device state), one with
    n = 2 (its choices fork), one under a regex."""
    from jpaged import SamplingParams
    from jpaged.engine.sampling import StructuredOutputsParams

    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=6, temperature=1.0, seed=3, ignore_eos=True)
    controlled = SamplingParams(
        max_tokens=6, temperature=0, ignore_eos=True, presence_penalty=1.5, logit_bias={11: 4.0}
    )
    n2 = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, n=2)
    # a grammar: the sampler waits for its mask, which process 0 broadcasts
    regex = SamplingParams(
        max_tokens=6, temperature=0, structured=StructuredOutputsParams(regex="[a-f]{3,5}")
    )
    return [*PROMPTS, LATER, PROMPTS[0]], [greedy, sampled, controlled, n2, greedy, regex]


def assembling_peak() -> list[int]:
    """Trace the host memory (NumPy's allocations) each `assemble` call peaks at."""
    from models import loader

    peaks: list[int] = []
    assemble = loader.assemble

    def traced(*args, **kwargs):  # type: ignore[no-untyped-def]
        tracemalloc.start()
        try:
            return assemble(*args, **kwargs)
        finally:
            peaks.append(tracemalloc.get_traced_memory()[1])
            tracemalloc.stop()

    loader.assemble = traced  # type: ignore[assignment]
    return peaks


def main() -> None:
    path, coordinator, processes, pid = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    distributed.initialize(coordinator, processes, pid, heartbeat_timeout_s=10)
    import jax
    from flax import nnx

    import jpaged
    import models

    peaks = assembling_peak()

    n = jax.device_count()
    model = models.load(path, dtype="float32", tensor_parallel=n)
    model_bytes = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model.model)))
    config = jpaged.EngineConfig(tensor_parallel=n, **ENGINE)  # type: ignore[arg-type]
    if pid:
        distributed.serve_worker(model, config)
        return
    llm = jpaged.LLM(model, tensor_parallel=n, **ENGINE)
    prompts, params = workload()
    outs = llm.generate(prompts[:4], params[:4]) + llm.generate(prompts[4:], params[4:])
    stats = llm.stats()
    print(
        json.dumps(
            {
                "tokens": [[c.token_ids for c in o.choices] for o in outs],
                "hits": stats["kv_prefix_cache_hits"],
                "used": stats["kv_blocks_used"],
                "assembling_peak": peaks[0],
                "model_bytes": model_bytes,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
