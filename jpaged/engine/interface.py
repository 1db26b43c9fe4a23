"""The engine interface: what the offline API (`LLM`), the async front, the server and its
CLI may ask of an engine, whichever it is (one `Engine`, data-parallel `Replicas`, the
distributed driver); and `PromptRequest`, a prompt with everything a caller asks of it,
the one argument that travels from the caller to `Intake.prepare`.

It sits below its users and its implementations: it imports neither.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Protocol

from jpaged.cache.groups import KVGroups
from jpaged.config import EngineConfig
from jpaged.engine.beam import BeamSearchParams
from jpaged.engine.lora import LoRARequest
from jpaged.engine.output import RequestOutput, RequestState
from jpaged.engine.request import Request
from jpaged.engine.sampling import SamplingParams
from jpaged.models.config import ModelConfig
from jpaged.models.loaded import LoadedModel


@dataclasses.dataclass(frozen=True)
class PromptRequest:
    """A prompt and what its caller asks of it, as the engine's intake reads it.

    `prompt`: text (tokenized by the intake) or token ids. `add_special_tokens`: whether
    a text prompt's tokens start with the tokenizer's own (BOS): a rendered chat template
    writes them itself. `fill_context`: `sampling.max_tokens` is a ceiling, the request
    generating at most what the context has left after its prompt (a chat that sets no
    max_tokens). `priority`: lower is admitted first and preempted last; `timeout_s`: from
    now, the deadline past which the request is aborted wherever it is (finish_reason
    "abort"); `pooling` ("last" or "mean"): an embedding request (`RequestOutput.embedding`);
    `lora`: the name of a registered LoRA adapter to serve it with; `images` (a
    vision-language model): PIL images or pixel arrays, one per image placeholder of the
    prompt, in order (`Intake.prepare`)."""

    prompt: str | Sequence[int]
    sampling: SamplingParams | BeamSearchParams
    request_id: str | None = None
    priority: int = 0
    timeout_s: float | None = None
    pooling: str | None = None
    lora: str | None = None
    images: Sequence[Any] | None = None
    add_special_tokens: bool = True
    fill_context: bool = False


class EngineInterface(Protocol):
    """An engine as its callers see it. Requests: `prepare` (thread-safe), then `add` once
    `room` allows (or `discard`); `step` until `has_unfinished` is false. Model, tokenizer
    and limits are the same on every replica."""

    config: EngineConfig
    model: LoadedModel  # (laid out over the engine's mesh)
    model_config: ModelConfig
    tokenizer: Any
    groups: KVGroups  # which layers share a page table
    block_bytes: int  # K, V (and scales) of one block, every layer

    @property
    def num_blocks(self) -> int:
        """The KV blocks of one replica's cache, the null block included."""
        ...

    @property
    def image_placeholder(self) -> str | None:
        """The text an image stands as in a text prompt; None: the model takes no images."""
        ...

    # -- requests
    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]: ...
    def prepare(self, request: PromptRequest) -> Request: ...
    def discard(self, request: Request) -> None: ...
    def room(self) -> int: ...
    def check_room(self, submitted: int = 0) -> None: ...
    def add(self, request: Request) -> RequestState: ...
    def abort(self, request_id: str) -> None: ...
    def has_unfinished(self) -> bool: ...

    # -- stepping
    def step(self) -> list[RequestOutput]: ...
    def fail_all(self, error: str) -> list[RequestOutput]: ...
    def mark_warm(self) -> None: ...

    # -- LoRA adapters
    def loras(self) -> dict[str, LoRARequest]: ...
    def register_lora(self, request: LoRARequest) -> None: ...
    def unregister_lora(self, name: str) -> None: ...

    # -- observability
    def stats(self) -> dict[str, float]: ...
    def weights(self) -> list[Any]:
        """Every replica's weight arrays (the device buffers the steps read)."""
        ...

    def audit(self) -> list[int]:
        """Blocks the allocators count in use that no live sequence holds (a leak), every
        replica's."""
        ...
