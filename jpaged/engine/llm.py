"""The offline API: `LLM(model).generate(prompts, params)`, `LLM(model).beam_search(prompts,
params)` and `generate(prompts, model=...)`."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
from tqdm import tqdm

from jpaged.config import EngineConfig
from jpaged.engine.beam import BeamSearchParams
from jpaged.engine.interface import EngineInterface, PromptRequest
from jpaged.engine.lora import LoRARequest, from_vllm
from jpaged.engine.output import RequestState
from jpaged.engine.request import Request
from jpaged.engine.router import build, replica_devices
from jpaged.engine.sampling import SamplingParams
from jpaged.models.common import CausalLM
from jpaged.models.loaded import LoadedModel

# text, token ids, or (a vision-language model) {"prompt": text or ids, "images": [...]}
# with PIL images for the prompt's image placeholders (`Intake.prepare`)
Prompt = str | Sequence[int] | dict[str, Any]


@dataclasses.dataclass
class CompletionChoice:
    """One of the `n` sampled continuations of a prompt."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    finish_reason: str  # "stop" | "length" | "error" | "abort"
    error: str | None


@dataclasses.dataclass
class Completion:
    """A prompt's completion: its own fields are those of the first choice; `choices`
    holds all `n` (one unless SamplingParams.n > 1)."""

    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    finish_reason: str  # "stop" | "length" | "error" | "abort"
    error: str | None
    ttft_s: float | None  # arrival to the first token of any choice
    latency_s: float  # arrival to the last choice's finish
    choices: list[CompletionChoice] = dataclasses.field(default_factory=list)
    # SamplingParams.prompt_logprobs: one entry per prompt token, the first None
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[dict[str, float] | None] | None = None
    # speculative decoding, over every choice: draft tokens verified, and accepted
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @classmethod
    def of(cls, state: RequestState) -> Completion:
        """A finished request's completion."""
        choices = [
            CompletionChoice(
                i,
                c.text,
                c.token_ids,
                c.logprobs,
                c.top_logprobs if state.params.logprobs else None,
                c.finish_reason or "abort",
                c.error,
            )
            for i, c in enumerate(state.choices)
        ]
        firsts = [c.first_token_time for c in state.choices if c.first_token_time is not None]
        first = choices[0]
        return cls(
            prompt_token_ids=state.prompt_ids,
            text=first.text,
            token_ids=first.token_ids,
            logprobs=first.logprobs,
            top_logprobs=first.top_logprobs,
            finish_reason=first.finish_reason,
            error=first.error,
            ttft_s=min(firsts) - state.arrival if firsts else None,
            latency_s=max(c.finish_time or 0.0 for c in state.choices) - state.arrival,
            choices=choices,
            prompt_logprobs=state.prompt_logprobs,
            prompt_top_logprobs=state.prompt_top_logprobs,
            num_draft_tokens=sum(c.num_draft_tokens for c in state.choices),
            num_accepted_tokens=sum(c.num_accepted_tokens for c in state.choices),
        )


@dataclasses.dataclass
class BeamSequence:
    """One hypothesis of a beam search."""

    token_ids: list[int]  # generated tokens only (the EOS that ended it included)
    text: str  # stop strings removed, as for sampled completions
    logprobs: list[float]  # each generated token's
    cum_logprob: float  # their sum
    score: float  # cum_logprob / len(token_ids) ** length_penalty: what ranks hypotheses
    finish_reason: str  # "stop" (EOS or a stop string) | "length" | "error" | "abort"


@dataclasses.dataclass
class BeamSearchOutput:
    """A prompt's beam search: its `beam_width` best hypotheses, best first."""

    prompt_token_ids: list[int]
    sequences: list[BeamSequence]
    error: str | None = None

    @classmethod
    def of(cls, state: RequestState, length_penalty: float) -> BeamSearchOutput:
        seqs = []
        for c in state.choices:
            cum = float(np.sum(c.logprobs, dtype=np.float64))
            score = cum / max(1, len(c.token_ids)) ** length_penalty
            seqs.append(
                BeamSequence(
                    c.token_ids, c.text, c.logprobs, cum, score, c.finish_reason or "abort"
                )
            )
        return cls(state.prompt_ids, seqs, next((c.error for c in state.choices if c.error), None))


class LLM:
    """Loads a checkpoint once and keeps the compiled engine across `generate` calls.

    `model`: a demo model's name ("smollm2-135m", "gemma-3-270m": fetched once), a checkpoint
    directory or `.gguf` path, or a `LoadedModel`. A name or path is loaded in the config's
    dtype (default "auto": bfloat16 on a GPU, float32 elsewhere), never in the one the
    checkpoint declares. `engine_options`: EngineConfig's fields, and vLLM's LoRA keywords
    (`enable_lora=True, max_loras=N, max_lora_rank=R`) for its `lora`.
    """

    def __init__(self, model: str | LoadedModel, **engine_options: Any) -> None:
        config = EngineConfig(**from_vllm(engine_options))
        if config.data_parallel > 1:
            replica_devices(config)  # too few devices: refused before loading
        if isinstance(model, str):
            from jpaged.models import load  # the model zoo is only needed when given a name or path

            model = load(
                model,
                dtype=config.dtype,
                tensor_parallel=config.tensor_parallel,
                quantization=config.quantization,
                activations=config.activations,
            )
        self.engine: EngineInterface = build(
            model, config
        )  # replicas behind a router if data_parallel
        self.tokenizer = model.tokenizer

    @property
    def model(self) -> CausalLM:
        """The `flax.nnx` module the engine runs (tensor-parallel: laid out over its mesh),
        to reuse outside the engine (`models.logits`)."""
        return self.engine.model.model

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[Completion]:
        """Completions in prompt order. Bad input raises before anything runs.

        `lora_request` (vLLM's): the LoRA adapter to serve every prompt with, or one per
        prompt (None: the base model); an adapter is registered under its name on first
        use (a new path under a known name replaces it)."""
        batch = _batch(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(batch)
        else:
            params = list(sampling_params)
            if len(params) != len(batch):
                raise ValueError(f"sampling_params: {len(params)} given for {len(batch)} prompts")
        loras = self._loras(lora_request, len(batch))
        requests: list[Request] = []
        try:
            for p, sp, lora in zip(batch, params, loras, strict=True):
                text, images = _prompt(p)
                requests.append(
                    self.engine.prepare(PromptRequest(text, sp, lora=lora, images=images))
                )
        except BaseException:
            for req in requests:  # refused as a whole: none holds its adapter
                self.engine.discard(req)
            raise
        return [Completion.of(s) for s in self._run(requests, use_tqdm, "generate")]

    def _loras(
        self, lora_request: LoRARequest | Sequence[LoRARequest | None] | None, n: int
    ) -> list[str | None]:
        """Each prompt's adapter name, registering the adapters not known yet."""
        if lora_request is None or isinstance(lora_request, LoRARequest):
            wanted = [lora_request] * n
        else:
            wanted = list(lora_request)
            if len(wanted) != n:
                raise ValueError(f"lora_request: {len(wanted)} given for {n} prompts")
        known = self.engine.loras()
        for req in {r for r in wanted if r is not None}:
            if known.get(req.lora_name) != req:
                self.engine.register_lora(req)
        return [None if r is None else r.lora_name for r in wanted]

    def beam_search(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: BeamSearchParams,
        *,
        use_tqdm: bool | None = None,
    ) -> list[BeamSearchOutput]:
        """Each prompt's `params.beam_width` best continuations, in prompt order: beams
        share the prompt's blocks and run beside other requests. Bad input raises before
        anything runs."""
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params must be BeamSearchParams, got {type(params).__name__}")
        requests = []
        for p in _batch(prompts):
            text, images = _prompt(p)
            requests.append(self.engine.prepare(PromptRequest(text, params, images=images)))
        states = self._run(requests, use_tqdm, "beam search")
        return [BeamSearchOutput.of(s, params.length_penalty) for s in states]

    def _run(self, requests: list[Request], use_tqdm: bool | None, what: str) -> list[RequestState]:
        """Run prepared requests to the end, feeding the engine as its queue has room."""
        show = use_tqdm if use_tqdm is not None else len(requests) >= 16
        bar = tqdm(total=len(requests), desc=what, disable=not show)
        pending = list(reversed(requests))
        states = []
        done = 0
        try:
            while done < len(requests):
                while pending and self.engine.room() > 0:  # feed as room frees
                    states.append(self.engine.add(pending.pop()))
                for out in self.engine.step():
                    if out.request_finished:
                        done += 1
                        bar.update(1)
        finally:
            for req in pending:  # never added (an exception, an interrupt)
                self.engine.discard(req)
            bar.close()
        return states

    def stats(self) -> dict[str, float]:
        return self.engine.stats()


def _batch(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """One prompt (text, token ids or a dict) or a list of them, as a list."""
    if isinstance(prompts, str | dict) or (prompts and isinstance(prompts[0], int)):
        return [prompts]  # type: ignore[list-item]
    return list(prompts)  # type: ignore[arg-type]


def _prompt(prompt: Prompt) -> tuple[str | Sequence[int], list[Any] | None]:
    """A prompt's text or ids, and its images (None: none)."""
    if not isinstance(prompt, dict):
        return prompt, None
    unknown = set(prompt) - {"prompt", "images"}
    if unknown or "prompt" not in prompt:
        raise ValueError(f"a prompt dict has 'prompt' and 'images', got {sorted(prompt)}")
    return prompt["prompt"], list(prompt.get("images") or []) or None


SAMPLING_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}


def generate(
    prompts: Prompt | Sequence[Prompt], model: str | LoadedModel, **options: Any
) -> list[Completion]:
    """One-shot: load `model`, generate, return completions in prompt order.

    Keywords naming a SamplingParams field go to sampling; the rest to EngineConfig. The
    engine compiles only the programs these prompts run (no warm-up, unless `warmup=True`):
    an `LLM` kept across calls is what pays for compiling every shape up front.
    """
    sampling = {k: v for k, v in options.items() if k in SAMPLING_FIELDS}
    engine_options = {k: v for k, v in options.items() if k not in SAMPLING_FIELDS}
    engine_options.setdefault("warmup", False)
    unknown = set(engine_options) - {f.name for f in dataclasses.fields(EngineConfig)}
    if unknown:
        raise TypeError(f"generate() got unknown options: {sorted(unknown)}")
    params = SamplingParams(**sampling)
    return LLM(model, **engine_options).generate(prompts, params)
