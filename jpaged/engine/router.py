"""Data parallelism: engine replicas behind one router, seen by callers as one engine.

`EngineConfig.data_parallel = N` builds N engines, replica i on devices
[i * tensor_parallel, (i + 1) * tensor_parallel) of `jax.devices()`, each with its own
weights, KV pool, allocator and scheduler (vLLM's `--data-parallel-size`). The router
sends each request to one replica, where it stays: its blocks and prefix hits are that
replica's. One thread steps every replica in turn; dispatch is asynchronous, so the
replicas' device work overlaps while the host schedules the next.

The rule (`Router.choose`): a prompt whose first full blocks hash like those of a recent
request goes where that request went (its blocks are likely in that replica's prefix
cache), unless that replica's load exceeds the least loaded one's by more than `slack`
tokens; then, and for prompts that match nothing, the least loaded replica wins (ties:
the lowest index). A replica's load is the work routed to it and not finished yet: each
request's prompt tokens plus `max_tokens` for each of its `n` choices. `slack` defaults
to one step's token budget (`max_num_batched_tokens`): a hot prefix may put that much
more work on its replica, no more. A replica whose waiting queue is full is passed over
while another has room.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import jax

from jpaged.cache.paged import block_key
from jpaged.config import EngineConfig
from jpaged.engine import speculative
from jpaged.engine.contract import CoreOutputs
from jpaged.engine.engine import Engine
from jpaged.engine.intake import QueueFullError
from jpaged.engine.interface import EngineInterface, PromptRequest
from jpaged.engine.lora import LoRARequest
from jpaged.engine.output import RequestOutput, RequestState
from jpaged.engine.request import Request
from jpaged.models.loaded import LoadedModel

# the router's statistics that only grow (Prometheus counters)
ROUTER_COUNTERS = (
    "router_prefix",
    "router_least_loaded",
    "router_prefix_overruled",
    "router_routed",
)
# statistics that are not sums over the replicas: recomputed (ratios) or taken once
_SAME = ("kv_block_bytes", "kv_value_bits")


def replica_devices(config: EngineConfig) -> list[list[jax.Device]]:
    """Each replica's devices; a ValueError naming the numbers when JAX has too few."""
    dp, tp = config.data_parallel, config.tensor_parallel
    devices = jax.devices()
    if dp * tp > len(devices):
        raise ValueError(
            f"data_parallel={dp} x tensor_parallel={tp} needs {dp * tp} devices, but JAX sees "
            f"{len(devices)} {jax.default_backend()} device(s)"
        )
    return [devices[i * tp : (i + 1) * tp] for i in range(dp)]


def build(model: LoadedModel, config: EngineConfig) -> Engine | Replicas:
    """One engine, or `config.data_parallel` replicas behind a router; over several
    processes (`jax.distributed`), process 0's engine, which drives the others."""
    if jax.process_count() > 1:
        from jpaged.engine import distributed

        return distributed.driver(model, config)
    return Engine(model, config) if config.data_parallel == 1 else Replicas(model, config)


class Router:
    """Picks a replica per request: prefix match first, least loaded otherwise (see the
    module's docstring for which wins). Counts its choices."""

    def __init__(
        self, n: int, block_size: int, slack: int, memory: int = 65536, max_blocks: int = 64
    ) -> None:
        self.n, self.block_size, self.slack = n, block_size, slack
        self.memory, self.max_blocks = memory, max_blocks
        self._where: collections.OrderedDict[bytes, int] = collections.OrderedDict()  # LRU
        self.routed = [0] * n
        self.counters = dict.fromkeys(ROUTER_COUNTERS[:3], 0)

    def keys(self, prompt_ids: Sequence[int]) -> list[bytes]:
        """The chained block keys of the prompt's full blocks (all but its last token, as
        the prefix cache looks them up), at most `max_blocks`."""
        bs, parent, keys = self.block_size, b"", []
        for k in range(min((len(prompt_ids) - 1) // bs, self.max_blocks)):
            parent = block_key(parent, prompt_ids[k * bs : (k + 1) * bs])
            keys.append(parent)
        return keys

    def choose(
        self, prompt_ids: Sequence[int], loads: Sequence[int], room: Sequence[int] | None = None
    ) -> int:
        """`room`: the requests each replica's waiting queue can still take; a full replica
        is never chosen while another has room."""
        keys = self.keys(prompt_ids)
        candidates = [i for i in range(self.n) if room is None or room[i] > 0]
        candidates = candidates or list(range(self.n))
        least = min(candidates, key=lambda i: loads[i])
        match = next((self._where[k] for k in reversed(keys) if k in self._where), None)
        if match in candidates and loads[match] - loads[least] <= self.slack:
            choice = match
            self.counters["router_prefix"] += 1
        else:
            choice = least
            self.counters["router_least_loaded"] += 1
            self.counters["router_prefix_overruled"] += match is not None and match != least
        for k in keys:
            self._where[k] = choice
            self._where.move_to_end(k)
        while len(self._where) > self.memory:
            self._where.popitem(last=False)
        self.routed[choice] += 1
        return choice


class Replicas:
    """`data_parallel` engines behind a `Router`, one engine to their callers (the
    `EngineInterface`). Model, tokenizer and limits are replica 0's (every replica's are
    the same); `replicas` lists the engines."""

    def __init__(self, model: LoadedModel, config: EngineConfig) -> None:
        self.engines = [Engine(model, config, devices) for devices in replica_devices(config)]
        first = self.engines[0]
        self.config, self.model, self.model_config = config, first.model, first.model_config
        self.tokenizer, self.groups = first.tokenizer, first.groups
        self.block_bytes = first.block_bytes
        self.router = Router(len(self.engines), config.block_size, config.max_num_batched_tokens)
        self.loads = [0] * len(self.engines)
        self._routed: dict[str, tuple[int, int]] = {}  # live request id -> (replica, load)
        self._aborts: set[str] = set()  # sent on at the next step (once routed: see abort)
        self._lock = threading.Lock()

    @property
    def replicas(self) -> list[Engine]:
        """The engines that hold KV blocks."""
        return list(self.engines)

    @property
    def num_blocks(self) -> int:
        return self.engines[0].num_blocks

    @property
    def image_placeholder(self) -> str | None:
        return self.engines[0].image_placeholder

    @property
    def decode_buckets(self) -> collections.Counter[int]:
        """Every replica's decode calls, by token bucket."""
        return sum((e.decode_buckets for e in self.engines), collections.Counter())

    def weights(self) -> list[Any]:
        return [w for e in self.engines for w in e.weights()]

    def audit(self) -> list[int]:
        return [b for e in self.engines for b in e.audit()]

    def mark_warm(self) -> None:
        for e in self.engines:
            e.mark_warm()

    # requests are prepared by replica 0's intake: every replica's would do the same
    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.engines[0].tokenize(text, add_special_tokens)

    def prepare(self, request: PromptRequest) -> Request:
        return self.engines[0].prepare(request)

    def discard(self, request: Request) -> None:
        self.engines[0].discard(request)  # prepare's

    def loras(self) -> dict[str, LoRARequest]:
        return self.engines[0].loras()  # every replica knows the same adapters

    def register_lora(self, request: LoRARequest) -> None:
        for e in self.engines:
            e.register_lora(request)

    def unregister_lora(self, name: str) -> None:
        for e in self.engines:
            e.unregister_lora(name)

    def check_room(self, submitted: int = 0) -> None:
        """Raise QueueFullError if `submitted` more requests would overflow the replicas'
        waiting queues."""
        if self.room() <= submitted:
            raise QueueFullError(
                f"waiting queue is full ({self.config.max_waiting_requests} requests)"
            )

    def room(self) -> int:
        return sum(e.room() for e in self.engines)

    def add(self, request: Request) -> RequestState:
        load = len(request.prompt_ids) + request.params.max_tokens * len(request.group)
        room = [e.room() for e in self.engines]
        with self._lock:
            i = self.router.choose(request.prompt_ids, self.loads, room)
            self.loads[i] += load
            self._routed[request.id] = (i, load)
        return self.engines[i].add(request)

    def abort(self, request_id: str) -> None:
        """Cancel a request at the next step: by then it is routed, if it was submitted to
        an engine loop that has not added it yet (thread-safe)."""
        self._aborts.add(request_id)

    def has_unfinished(self) -> bool:
        return any(e.has_unfinished() for e in self.engines)

    def core_step(self) -> CoreOutputs:
        """A step of every replica with work, one after the other (each dispatches its
        step and returns its previous one's results, so their device work overlaps)."""
        while self._aborts:  # (abort() may add to the set meanwhile)
            request_id = self._aborts.pop()
            routed = self._routed.get(request_id)
            if routed is not None:
                self.engines[routed[0]].abort(request_id)
        out = CoreOutputs()
        for e in self.engines:
            if e.has_unfinished():
                out.extend(e.core_step())
        return out

    def step(self) -> list[RequestOutput]:
        """`Engine.step` over the replicas."""
        outputs = self.process(self.core_step())
        self.finish_stopped()
        return outputs

    def finish_stopped(self) -> None:
        for e in self.engines:
            e.finish_stopped()

    def process(self, out: CoreOutputs) -> list[RequestOutput]:
        # each replica's output processor takes its own requests' entries
        outs = [o for e in self.engines for o in e.process(out)]
        self._release(outs)
        return outs

    def fail_all(self, error: str) -> list[RequestOutput]:
        outs = [out for e in self.engines for out in e.fail_all(error)]
        self._release(outs)
        return outs

    def _release(self, outs: list[RequestOutput]) -> None:
        with self._lock:
            for out in outs:
                if out.request_finished and out.request_id in self._routed:
                    i, load = self._routed.pop(out.request_id)
                    self.loads[i] -= load

    def stats(self) -> dict[str, float]:
        """Totals over the replicas (ratios recomputed from them), each replica's own
        under a `{replica="i"}` label, and the router's choices."""
        each = [e.stats() for e in self.engines]
        total: dict[str, float] = {k: float(sum(s[k] for s in each)) for k in each[0]}
        for k in _SAME:
            total[k] = each[0][k]
        total["kv_uptime_s"] = max(s["kv_uptime_s"] for s in each)
        slots = total["kv_blocks_used"] * self.config.block_size
        total["kv_utilization"] = total["kv_tokens_stored"] / slots if slots else 0.0
        total["kv_fragmentation"] = total["kv_fragmentation_slots"] / slots if slots else 0.0
        queries = total["kv_prefix_cache_queries"]
        total["kv_prefix_cache_hit_rate"] = (
            total["kv_prefix_cache_hits"] / queries if queries else 0.0
        )
        if "spec_drafts" in total:
            total.update(speculative.rates(total))
        with self._lock:
            total.update({k: float(v) for k, v in self.router.counters.items()})
            for i, s in enumerate(each):
                label = f'{{replica="{i}"}}'
                total.update({k + label: v for k, v in s.items()})
                total["router_routed" + label] = float(self.router.routed[i])
                total["router_load_tokens" + label] = float(self.loads[i])
        total["data_parallel"] = float(len(self.engines))
        return total


if TYPE_CHECKING:  # both kinds of engine are the interface (mypy checks it here)
    _one: type[EngineInterface] = Engine
    _many: type[EngineInterface] = Replicas
