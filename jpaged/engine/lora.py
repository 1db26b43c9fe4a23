"""LoRA adapter slots: which adapters are resident on the device, in which slot, for whom.

The step reads every resident adapter from one stacked array per projection
(`models.lora.LoRABatch`), `max_loras` slots (slot 0, "no adapter", is implicit: its
tokens' one-hot row is zero). Loading an adapter writes its padded arrays into a slot
(one jitted, donating update of fixed shapes: no compilation as adapters come and go).

Adapters are registered by name (vLLM's `LoRARequest`), read from disk (outside the
engine's lock: a load must not stall steps) and kept in host memory at their own rank, at
most `max_cpu_loras` of them (vLLM's; the least recently used copy that no request holds
is dropped, and read again when a request names it: at intake, in the intake thread). A
request holds its adapter's slot from admission to its end, so an adapter in use is never
evicted. With more adapters wanted than slots the least recently used idle one is
evicted; if every slot is in use the request waits.

A request also holds a reference on its adapter from intake (`Engine.prepare`) to its end,
however it ends: while it waits it carries only the adapter's name, so unloading (or
replacing) an adapter is refused while any request holds it (`AdapterInUse`).
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jpaged.models import sharding
from jpaged.models.config import ModelConfig
from jpaged.models.lora import Adapter, LoRABatch, dims, load_adapter

LORA_COUNTERS = ("lora_loads", "lora_evictions")  # `LoRASlots.stats` keys that only grow


@dataclasses.dataclass(frozen=True)
class LoRARequest:
    """vLLM's: an adapter by name, a positive integer id unique to it, and its directory."""

    lora_name: str
    lora_int_id: int
    lora_path: str


class AdapterInUse(ValueError):
    """Unloading or replacing an adapter that `requests` requests hold."""

    def __init__(self, name: str, requests: int) -> None:
        s = "" if requests == 1 else "s"
        super().__init__(f"adapter {name!r} is in use by {requests} request{s}")
        self.requests = requests


VLLM_KEYWORDS = ("enable_lora", "max_loras", "max_lora_rank", "max_cpu_loras")


def from_vllm(options: dict[str, Any]) -> dict[str, Any]:
    """`EngineConfig` keywords with vLLM's `enable_lora=True, max_loras=N, max_lora_rank=R`
    (`LLM`'s) turned into `lora={"max_loras": N, "max_lora_rank": R}`."""
    given = {k: options[k] for k in VLLM_KEYWORDS if k in options}
    if not given:
        return options
    rest = {k: v for k, v in options.items() if k not in VLLM_KEYWORDS}
    if "lora" in rest:
        raise ValueError("LoRA: give lora={...} or enable_lora=True (vLLM's keywords), not both")
    enable = given.pop("enable_lora", False)
    if not isinstance(enable, bool):
        raise ValueError(f"enable_lora must be a bool, got {enable!r}")
    if not enable and given:  # (vLLM ignores them: a LoRA setting that does nothing)
        raise ValueError(f"{', '.join(given)}: set only with enable_lora=True")
    return {**rest, "lora": given} if enable else rest


def _specs(name: str) -> tuple[P, P]:
    """A/B `[L, S, in, R]` / `[L, S, R, out]` split like their layer: a column-parallel
    layer's B on `out`, a row-parallel layer's A on `in` (XLA sums the partial products)."""
    if name in ("o", "down"):
        return P(None, None, sharding.AXIS, None), P()
    return P(), P(None, None, None, sharding.AXIS)


def _write(
    weights: dict[str, tuple[jax.Array, jax.Array]],
    index: jax.Array,
    new: dict[str, tuple[jax.Array, jax.Array]],
) -> dict[str, tuple[jax.Array, jax.Array]]:
    return jax.tree.map(lambda w, n: w.at[:, index].set(n.astype(w.dtype)), weights, new)


# One program for every slot and adapter (slot and weights are arguments, shapes fixed).
_write_donated = jax.jit(_write, donate_argnums=0)


class LoRASlots:
    def __init__(
        self, spec: dict, config: ModelConfig, dtype: Any, mesh: Mesh | None = None
    ) -> None:
        self.max_loras, self.max_rank = spec["max_loras"], spec["max_lora_rank"]
        self.max_cpu = spec.get("max_cpu_loras") or self.max_loras
        self.config = config
        s, r, n = self.max_loras, self.max_rank, config.num_layers

        def zeros(shape: tuple[int, ...], spec: P) -> jax.Array:
            # placed explicitly (committed), as the writer's outputs are: a program compiled
            # for the first arrays then serves the later ones too
            place = jax.devices()[0] if mesh is None else NamedSharding(mesh, spec)
            return jax.device_put(np.zeros(shape, dtype), place)

        self.weights = {
            name: (
                zeros((n, s, din, r), _specs(name)[0]),
                zeros((n, s, r, dout), _specs(name)[1]),
            )
            for name, (din, dout) in dims(config).items()
        }
        self.registered: dict[str, LoRARequest] = {}
        # host copies, least recently used first; guarded by `_refs`
        self._host: collections.OrderedDict[str, Adapter] = collections.OrderedDict()
        self._slot_of: collections.OrderedDict[str, int] = collections.OrderedDict()  # LRU
        self._free = list(range(s, 0, -1))
        self.running: collections.Counter[str] = collections.Counter()  # slot holders
        # requests from intake to their end, per adapter (`hold`); intake runs in the
        # server's threads, beside the engine's: `_refs` keeps its check-and-count whole
        self.held: collections.Counter[str] = collections.Counter()
        self._refs = threading.Lock()
        self.loads = self.evictions = 0

    def read(self, request: LoRARequest) -> Adapter:
        """The adapter's files as a host copy (touches no state: any thread, no lock). A bad
        one raises ValueError, naming the file and field."""
        return load_adapter(request.lora_path, self.config, self.max_rank)

    def register(self, request: LoRARequest, adapter: Adapter | None = None) -> None:
        """Know an adapter by name, its host copy `adapter` (`read` now if not given); the
        same name again replaces it once no request holds it (AdapterInUse until then)."""
        name = self._idle(request.lora_name)
        if adapter is None:
            adapter = self.read(request)
        with self._refs:  # (a request may have taken the old one while this one loaded)
            self._idle(name)
            self.registered[name] = request
            self._host.pop(name, None)
            self._keep(name, adapter)
        self._drop(name)

    def unregister(self, name: str) -> None:
        """Forget adapter `name`: KeyError if unknown, AdapterInUse while a request holds it."""
        with self._refs:
            if name not in self.registered:
                raise KeyError(name)
            self._idle(name)
            del self.registered[name]
            self._host.pop(name, None)
        self._drop(name)

    def hold(self, request: LoRARequest) -> bool:
        """Count one more request on this adapter, from its intake to its end (`unhold`);
        False if it is no longer the one registered under its name. A host copy dropped
        since is read again here, in the caller's thread (ValueError if it no longer
        reads), so the engine's step finds it when the request is admitted."""
        name = request.lora_name
        with self._refs:
            if self.registered.get(name) != request:
                return False
            self.held[name] += 1
            if name in self._host:
                self._host.move_to_end(name)
                return True
        try:
            adapter = self.read(request)
        except Exception:
            self.unhold(name)
            raise
        with self._refs:
            if name not in self._host:
                self._keep(name, adapter)
        return True

    def _keep(self, name: str, adapter: Adapter) -> None:
        """Keep `adapter` as `name`'s host copy, dropping the least recently used copies no
        request holds down to max_cpu_loras. Copies that requests hold stay: only they can
        take the count past it, while they run or wait (caller holds `_refs`)."""
        self._host[name] = adapter
        self._trim(spare=name)
        if len(self._host) > self.max_cpu and not self.held[name]:
            del self._host[name]  # (registered beside held ones: read on first use)

    def _trim(self, spare: str | None = None) -> None:
        """Drop the least recently used host copies no request holds (but `spare`'s) down
        to max_cpu_loras (caller holds `_refs`)."""
        idle = [n for n in self._host if not self.held[n] and n != spare]
        for victim in idle[: max(0, len(self._host) - self.max_cpu)]:
            del self._host[victim]

    def unhold(self, name: str) -> None:
        with self._refs:
            self.held[name] -= 1
            if self.held[name] <= 0:
                del self.held[name]
                self._trim()  # (past the cap while more copies were held)

    def _idle(self, name: str) -> str:
        """`name`, if no request holds it; else AdapterInUse."""
        requests = max(self.held[name], self.running[name])
        if requests:
            raise AdapterInUse(name, requests)
        return name

    def usable(self, name: str) -> bool:
        """Whether adapter `name` can take a slot: registered, and resident or with its host
        copy (a request's reference keeps both; a bug elsewhere must fail it alone)."""
        with self._refs:
            known = name in self.registered and name in self._host
        return known or name in self.registered and name in self._slot_of

    def acquire(self, name: str) -> int | None:
        """The slot of adapter `name` for one more request, loading it (evicting the least
        recently used idle adapter if no slot is free); None when every slot is in use."""
        if name not in self.registered:
            raise KeyError(name)
        slot = self._slot_of.get(name)
        if slot is None:
            if not self._free:
                idle = next((a for a in self._slot_of if not self.running[a]), None)
                if idle is None:
                    return None
                self._drop(idle)
                self.evictions += 1
            slot = self._free.pop()
            with self._refs:  # (the intake threads reorder the copies)
                adapter = self._host[name]
            self._load(slot, adapter)
            self._slot_of[name] = slot
        self._slot_of.move_to_end(name)
        self.running[name] += 1
        return slot

    def release(self, name: str) -> None:
        self.running[name] -= 1
        if self.running[name] <= 0:
            del self.running[name]

    def batch(self, slots: jax.Array) -> LoRABatch:
        return LoRABatch(slots, self.weights)

    def warmup(self) -> None:
        """Compile the slot writer (zeros into the first slot, which is free)."""
        zero = {k: (np.zeros(a.shape[2:], np.float32), np.zeros(b.shape[2:], np.float32))
                for k, (a, b) in self.weights.items()}  # fmt: skip
        self.weights = _write_donated(self.weights, jnp.int32(0), zero)

    def stats(self) -> dict[str, float]:
        out: dict[str, float] = {
            "lora_resident": len(self._slot_of),
            "lora_registered": len(self.registered),
            "lora_host_copies": len(self._host),
            "lora_loads": self.loads,
            "lora_evictions": self.evictions,
        }
        for name, n in self.running.items():
            # Prometheus' escapes: a name must not end the label, nor the line
            label = name.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
            out[f'lora_running{{adapter="{label}"}}'] = n
        return out

    def _load(self, slot: int, adapter: Adapter) -> None:
        padded = adapter.padded(self.max_rank)  # (transient: only the slot keeps its size)
        self.weights = _write_donated(self.weights, jnp.int32(slot - 1), padded)
        self.loads += 1

    def _drop(self, name: str) -> None:
        """Forget where `name` is resident (its slot's stale weights are overwritten when
        the slot is loaded next; no token names a free slot)."""
        slot = self._slot_of.pop(name, None)
        if slot is not None:
            self._free.append(slot)
