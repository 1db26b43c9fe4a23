"""Driving an Engine in this process: requests added at their arrival times, the engine
stepped until all finish, `engine.stats()` sampled after every step."""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import workloads
from benchmarks.common import build_engine, loadavg
from benchmarks.serving.configs import BenchConfig
from benchmarks.serving.measure import (
    TIMELINE_KEYS,
    PassResult,
    RequestRecord,
    new_timeline,
    pass_result,
)


def serve_pass(
    engine: Any,
    workload: workloads.Workload,
    *,
    temperature: float,
    label: str = "",
    progress: bool = True,
    loras: Sequence[str] = (),
) -> PassResult:
    """Add each request at its arrival time and step the engine until all finish, sampling
    `engine.stats()` after every step. With `loras`, request i is served with adapter
    `loras[i % len(loras)]`."""
    from tqdm import tqdm

    from jpaged.engine.interface import PromptRequest
    from jpaged.engine.sampling import SamplingParams

    reqs = [
        engine.prepare(
            PromptRequest(
                list(w.prompt_ids),
                SamplingParams(
                    max_tokens=w.max_tokens, temperature=temperature, ignore_eos=True, seed=i
                ),
                lora=loras[i % len(loras)] if loras else None,
            )
        )
        for i, w in enumerate(workload.requests)
    ]
    order = sorted(range(len(reqs)), key=lambda i: workload.requests[i].arrival_s)
    records = [RequestRecord(arrival=0.0) for _ in reqs]
    index = {r.id: i for i, r in enumerate(reqs)}
    timeline = new_timeline()

    def sample(now: float) -> None:
        s = engine.stats()
        timeline["t"].append(now)
        timeline["running"].append(s["running"])
        timeline["waiting"].append(s["waiting"])
        for k in TIMELINE_KEYS[2:]:
            timeline[k].append(s[f"kv_{k}"])

    monitor_s = 0.0
    cpu0 = os.times()
    bar = tqdm(total=len(reqs), desc=label, unit="req", disable=not progress)
    start = time.perf_counter()
    sample(0.0)
    nxt = done = 0
    while done < len(reqs):
        now = time.perf_counter() - start
        while nxt < len(order) and workload.requests[order[nxt]].arrival_s <= now:
            i = order[nxt]
            records[i].arrival = now
            engine.add(reqs[i])
            nxt += 1
        if not engine.has_unfinished():
            time.sleep(max(0.0, workload.requests[order[nxt]].arrival_s - now))
            continue
        outs = engine.step()
        now = time.perf_counter() - start
        for out in outs:
            rec = records[index[out.request_id]]
            rec.token_times += [now] * len(out.token_ids)
            rec.tokens += len(out.token_ids)
            if out.finished:
                rec.finish = now
                rec.error = out.error if out.finish_reason == "error" else None
                done += 1
                bar.update(1)
        m0 = time.perf_counter()
        sample(now)
        monitor_s += time.perf_counter() - m0
    wall_s = time.perf_counter() - start
    cpu1 = os.times()
    bar.close()
    cpu_s = (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)
    return PassResult(records, timeline, wall_s, cpu_s, monitor_s)


def random_adapters(
    config: Any, count: int, rank: int, root: Path, scale: float = 0.01
) -> list[Any]:
    """`count` PEFT adapters of `rank` under `root`, every projection of every layer
    targeted, random A and B (B's entries of deviation `scale`: small, the adapted model
    stays sane): what serving many fine-tunes costs does not depend on what they learned."""
    from safetensors.numpy import save_file

    from jpaged.engine.lora import LoRARequest
    from jpaged.models.lora import MODULES, dims

    shapes = dims(config)
    requests = []
    for n in range(count):
        rng = np.random.default_rng(n)
        path = root / f"adapter{n}"
        path.mkdir(parents=True)
        cfg = {"peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": list(MODULES)}
        (path / "adapter_config.json").write_text(json.dumps(cfg))
        weights = {}
        for layer in range(config.num_layers):
            for hf, ours in MODULES.items():
                din, dout = shapes[ours]
                block = "self_attn" if ours in ("q", "k", "v", "o") else "mlp"
                key = f"base_model.model.model.layers.{layer}.{block}.{hf}"
                weights[f"{key}.lora_A.weight"] = rng.normal(0, din**-0.5, (rank, din))
                weights[f"{key}.lora_B.weight"] = rng.normal(0, scale, (dout, rank))
        save_file({k: v.astype(np.float32) for k, v in weights.items()},
                  str(path / "adapter_model.safetensors"))  # fmt: skip
        requests.append(LoRARequest(f"adapter{n}", n + 1, str(path)))
    return requests


class InProcessTarget:
    """One configuration in this process: a fresh engine, warmed up off the clock
    (`warm_up`), then any number of measured passes (`measure`).

    `warmup='workload'` serves the workload once unmeasured (with fresh prompt ids, so
    a prefix cache has nothing to reuse) instead of compiling every bucket; only the
    shapes it uses get compiled, and a measured pass must compile none.
    """

    def __init__(
        self,
        model: Any,
        cfg: BenchConfig,
        *,
        warmup: str,
        temperature: float,
        progress: bool = True,
    ) -> None:
        self.model, self.cfg, self.warmup = model, cfg, warmup
        self.temperature, self.progress = temperature, progress
        self.engine: Any = None
        self.warmup_s = 0.0
        self.loras: list[str] = []
        self._adapter_dir: tempfile.TemporaryDirectory | None = None

    def warm_up(self, workload: workloads.Workload) -> None:
        cfg, warmup = self.cfg, self.warmup
        t = time.perf_counter()
        engine = self.engine = build_engine(
            self.model, cfg.engine_config(), warmup=warmup == "engine"
        )
        if cfg.lora is not None:
            self._adapter_dir = tempfile.TemporaryDirectory()
            root = Path(self._adapter_dir.name)
            for request in random_adapters(self.model.config, *cfg.lora, root):
                engine.register_lora(request)
                self.loras.append(request.lora_name)
        if warmup == "workload":
            warm = workload.with_fresh_tokens(seed=1, vocab_size=self.model.config.vocab_size)
            serve_pass(
                engine,
                warm,
                temperature=self.temperature,
                label=f"{cfg.label} warm-up pass",
                progress=self.progress,
                loras=self.loras,
            )
            engine.mark_warm()
        self.warmup_s = time.perf_counter() - t
        self.compilations_at_warmup = engine.stats()["compilations"]
        replicas = engine.replicas
        self.kv_bytes = sum(int(e.runner.kv.nbytes) for e in replicas)
        self.blocks_total = sum(int(e.cache.num_blocks - 1) for e in replicas)
        each = f"{len(replicas)} x " if len(replicas) > 1 else ""
        print(
            f"{cfg.label}: KV pool {self.kv_bytes:,} bytes ({self.kv_bytes / 2**20:.1f} MiB, "
            f"{each}{engine.num_blocks} blocks x {cfg.block_size} tokens incl. the null "
            f"block); warm-up ({warmup}) {self.warmup_s:.1f} s",
            flush=True,
        )

    def measure(self, workload: workloads.Workload) -> dict[str, Any]:
        import jax

        engine = self.engine
        assert engine is not None, "warm_up first"
        load_before = loadavg()
        before, buckets0 = engine.stats(), engine.decode_buckets.copy()
        run = serve_pass(
            engine,
            workload,
            temperature=self.temperature,
            label=self.cfg.label,
            progress=self.progress,
            loras=self.loras,
        )
        after = engine.stats()
        buckets = engine.decode_buckets - buckets0  # a decode-only call's token bucket -> calls
        return pass_result(
            self.cfg,
            run,
            before,
            after,
            mode="in-process",
            warmup=self.warmup,
            warmup_s=self.warmup_s,
            kv_bytes=self.kv_bytes,
            blocks_total=self.blocks_total,
            compilations_at_warmup=self.compilations_at_warmup,
            load_before=load_before,
            decode_buckets={f"{k}t": v for k, v in buckets.most_common()},
            param_bytes_per_device=sum(
                leaf.addressable_shards[0].data.nbytes
                for leaf in jax.tree.leaves(engine.replicas[0].runner.state)
            ),
            **self._lora_bytes(engine),
        )

    def _lora_bytes(self, engine: Any) -> dict[str, int]:
        """What one resident adapter costs on the device: its slot of the stacked arrays
        (padded to the rank asked for, every projection)."""
        slots = engine.replicas[0].runner.lora
        if slots is None:
            return {}
        total = sum(a.nbytes + b.nbytes for a, b in slots.weights.values())
        return {"lora_bytes_per_adapter": total // slots.max_loras}

    def close(self) -> None:
        self.engine = None
        if self._adapter_dir is not None:
            self._adapter_dir.cleanup()


def run_in_process(
    model: Any,
    cfg: BenchConfig,
    workload: workloads.Workload,
    *,
    warmup: str,
    temperature: float,
    progress: bool = True,
) -> dict[str, Any]:
    """One configuration, warmed up, measured once."""
    target = InProcessTarget(model, cfg, warmup=warmup, temperature=temperature, progress=progress)
    target.warm_up(workload)
    try:
        return target.measure(workload)
    finally:
        target.close()
