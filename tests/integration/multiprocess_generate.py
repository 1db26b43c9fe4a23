"""`python tests/integration/multiprocess_generate.py CHECKPOINT COORDINATOR PROCESSES ID
[variants]`: one process of a model split over every process's devices (test_multiprocess.py
starts them). Process 0 generates test_multiprocess's workload and prints its token ids as
JSON; the others mirror it and exit when it does. With `variants`, the workload is
`variants()` on an engine that drafts, and every process prints the device calls it made."""

from __future__ import annotations

import json
import sys
import tracemalloc
from typing import Any

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


# n-gram drafts of up to 3 tokens
SPECULATIVE = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}


def variants() -> tuple[list, list, Any, Any]:
    """The step shapes and samplers a plain workload never makes: a repetitive prompt's
    drafts, logprobs with alternatives, and the prompt and parameters of a beam search
    (its sampler searches 8 alternatives)."""
    from jpaged import BeamSearchParams, SamplingParams

    drafted = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    logprobs = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=3)
    beams = BeamSearchParams(beam_width=4, max_tokens=4, ignore_eos=True)
    return [[5, 6, 7] * 4, PROMPTS[1]], [drafted, logprobs], PROMPTS[2], beams


def generate_variants(llm: Any) -> dict[str, Any]:
    prompts, params, beam_prompt, beams = variants()
    outs = llm.generate(prompts, params)
    (searched,) = llm.beam_search([beam_prompt], beams)
    scored = outs[1]
    assert scored.top_logprobs is not None
    return {
        "tokens": [o.token_ids for o in outs],
        "logprobs": scored.logprobs,
        "top": [v for t in scored.top_logprobs for v in sorted(t.values())],
        "beams": [s.token_ids for s in searched.sequences],
        "drafts": llm.stats()["spec_drafts"],
    }


def trace_calls() -> list[list]:
    """Record each device call a runner makes: its function, static arguments and the
    shapes of its inputs (the program it runs)."""
    import jax

    from jpaged.engine.runner import Runner

    calls: list[list] = []
    counted = Runner._counted

    def traced(self, fn, *args, **kwargs):  # type: ignore[no-untyped-def]
        static = {k: str(kwargs[k]) for k in ("shape", "greedy", "top") if k in kwargs}
        shapes = [list(getattr(x, "shape", ())) for x in jax.tree.leaves(args)]
        calls.append([getattr(fn, "__name__", str(fn)), static, shapes])
        return counted(self, fn, *args, **kwargs)

    Runner._counted = traced  # type: ignore[method-assign]
    return calls


def assembling_peak() -> list[int]:
    """Trace the host memory (NumPy's allocations) each `assemble` call peaks at."""
    from jpaged.models import loader

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
    from jpaged import models

    peaks = assembling_peak()
    mode = sys.argv[5] if len(sys.argv) > 5 else ""
    engine = {**ENGINE, "speculative": SPECULATIVE} if mode == "variants" else ENGINE
    calls = trace_calls() if mode == "variants" else []

    n = jax.device_count()
    model = models.load(path, dtype="float32", tensor_parallel=n)
    model_bytes = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model.model)))
    config = jpaged.EngineConfig(tensor_parallel=n, **engine)  # type: ignore[arg-type]
    if pid:
        distributed.serve_worker(model, config)
        if mode == "variants":
            print(json.dumps({"calls": calls}), flush=True)
        return
    llm = jpaged.LLM(model, tensor_parallel=n, **engine)
    if mode == "variants":
        print(json.dumps({**generate_variants(llm), "calls": calls}), flush=True)
        return
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
