"""Request intake: a caller's `PromptRequest` checked against the engine's limits,
tokenized and made a `Request` (its seed drawn, its grammar compiled, its stop strings a
beam search's check, its LoRA adapter held); and the error a full waiting queue raises
(`Engine.check_room`).

The one place a prompt's text becomes token ids and its image placeholders their image
tokens (`tokenize`): the server renders chat templates and hands the text over. It runs
in the caller's thread (the async front's prepare worker, the offline API's),
beside the engine's step: it reads the adapter registry, never the scheduler.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jpaged.config import EngineConfig
from jpaged.engine import images as image_spans
from jpaged.engine.beam import BeamSearch, BeamSearchParams
from jpaged.engine.interface import PromptRequest
from jpaged.engine.lora import LoRARequest, LoRASlots
from jpaged.engine.output import DETOKENIZE_CONTEXT
from jpaged.engine.request import Request
from jpaged.engine.sampling import (
    SEED_MAX,
    ContextLengthError,
    RequestError,
    SamplingParams,
    choice_seed,
)
from jpaged.engine.structured import GrammarCompiler
from jpaged.models.config import ModelConfig
from jpaged.models.gemma3_vision import Gemma3VisionConfig
from jpaged.models.image import ImageProcessing, preprocess


class QueueFullError(Exception):
    """The waiting queue holds max_waiting_requests already."""


Spans = tuple[image_spans.ImageSpan, ...]  # a prompt's images, where their tokens lie


def _check(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise RequestError(field, message)


class Intake:
    """`loras`: the adapter registry (None with LoRA off); `max_seq_tokens`: the most
    tokens the KV cache holds for one sequence."""

    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        tokenizer: Any,
        grammars: GrammarCompiler,
        max_seq_tokens: int,
        loras: LoRASlots | None,
        vision: Gemma3VisionConfig | None = None,
        processing: ImageProcessing | None = None,
    ) -> None:
        """`vision`, `processing`: a vision-language model's image tokens and its images'
        preprocessing (None: the model takes no images)."""
        self.config, self.model_config, self.tokenizer = config, model_config, tokenizer
        self.grammars, self.max_seq_tokens, self.loras = grammars, max_seq_tokens, loras
        self.vision, self.processing = vision, processing or ImageProcessing()
        self._rng = np.random.default_rng(config.seed)

    def adapters(self) -> dict[str, LoRARequest]:
        """The LoRA adapters registered, by name."""
        return {} if self.loras is None else dict(self.loras.registered)

    def prepare(self, asked: PromptRequest) -> Request:
        """Validate and tokenize (thread-safe): `asked` as a `Request`, which must be
        added, or else given to `discard` (it holds a reference on its LoRA adapter).

        With `sampling.n > 1` the returned request leads a group of `n` choices
        (`request.group`), one id, seeds derived from the request's seed; with
        BeamSearchParams, a group of `beam_width` beams searching together.

        `images` (a vision-language model): PIL images, or pixel arrays `models.image.
        preprocess` made, one per image placeholder of the prompt, in order. A text prompt's
        placeholders are `<start_of_image>` (each becomes the image's tokens as
        transformers' processor expands it); token ids hold each image's tokens already
        (`<start_of_image>`, `mm_tokens_per_image` image tokens, `<end_of_image>`).
        """
        beam: BeamSearchParams | None = None
        params = asked.sampling
        if isinstance(params, BeamSearchParams):
            beam, params = params, params.sampling()
        what = "n" if beam is None else "beam_width"
        n = params.n
        _check(
            n <= self.config.max_batch_size,
            what,
            f"{what}: {n} {'choices' if beam is None else 'beams'} exceed max_batch_size "
            f"({self.config.max_batch_size}), the sequences one step can decode",
        )
        _check(
            n <= self.model_config.vocab_size,
            what,
            f"{what}: {n} exceeds the vocabulary ({self.model_config.vocab_size} tokens)",
        )
        ids, spans = self._prompt_ids(asked)
        if asked.fill_context:  # at most what the context leaves, 1 at least (checked below)
            room = self.config.max_seq_len - len(ids)
            params = dataclasses.replace(params, max_tokens=max(1, min(params.max_tokens, room)))
        self._check_room(ids, params)
        _check(
            asked.timeout_s is None or asked.timeout_s > 0, "timeout", "timeout must be > 0 seconds"
        )
        pooling = asked.pooling
        _check(pooling in (None, "last", "mean"), "pooling", "pooling must be last or mean")
        # the other processes mirror sampling steps, not embedding calls
        _check(
            pooling is None or (n == 1 and jax.process_count() == 1),
            "input",
            "embeddings take one choice, on a model in one process",
        )
        _check(pooling is None or asked.lora is None, "lora", "embeddings take no LoRA adapter")
        known = self.adapters()
        lora = asked.lora
        if lora is not None:
            _check(lora in known, "lora", f"lora: no adapter {lora!r} (known: {sorted(known)})")
        adapter = None if lora is None else known[lora]
        req = self._choices(asked, params, beam, ids, spans, adapter)
        if adapter is not None:
            # Taken last, once nothing can refuse the request: its end gives it back.
            # Until then unloading the adapter is refused (waiting, the request holds
            # only its name).
            assert self.loras is not None
            try:
                held = self.loras.hold(adapter)
            except ValueError as exc:  # its host copy, dropped, no longer reads
                raise RequestError("lora", f"lora: adapter {lora!r}: {exc}") from None
            _check(held, "lora", f"lora: adapter {lora!r} was unloaded")
            req.holds_lora = True
        return req

    def _prompt_ids(
        self, asked: PromptRequest
    ) -> tuple[list[int], tuple[image_spans.ImageSpan, ...]]:
        """The prompt's token ids (text tokenized, ids checked) and its images' spans."""
        prompt, images = asked.prompt, asked.images
        pixels: list[np.ndarray] = []
        if images:
            _check(self.vision is not None, "images", "images: this model takes no images")
            _check(asked.pooling is None, "images", "images: embeddings take no images")
            pixels = [self._pixels(i, image) for i, image in enumerate(images)]
        vocab = self.model_config.vocab_size
        if isinstance(prompt, str):
            _check(bool(prompt), "prompt", "prompt must not be empty")
            ids = self.tokenize(prompt, asked.add_special_tokens, bool(images))
        else:
            ids = list(prompt)
            _check(
                all(isinstance(t, int | np.integer) and 0 <= t < vocab for t in ids),
                "prompt",
                f"prompt token ids must be ints in [0, {vocab})",
            )
        _check(bool(ids), "prompt", "prompt must not be empty")
        if not images:
            return [int(t) for t in ids], ()
        assert self.vision is not None
        try:
            spans = image_spans.spans(ids, self.vision.image_token_id, pixels)
        except ValueError as exc:
            raise RequestError("images", f"images: {exc}") from None
        _check(
            self.vision.mm_tokens_per_image <= self.config.max_num_batched_tokens,
            "images",
            f"images: an image's {self.vision.mm_tokens_per_image} tokens exceed "
            f"max_num_batched_tokens ({self.config.max_num_batched_tokens}), the most "
            "one step computes (an image is computed in one step)",
        )
        return [int(t) for t in ids], spans

    def _check_room(self, ids: list[int], params: SamplingParams) -> None:
        """The prompt and the tokens it asks for fit the context and the cache; the token
        ids the parameters name are the vocabulary's."""
        max_seq_len = self.config.max_seq_len
        if len(ids) >= max_seq_len:
            raise ContextLengthError(
                "prompt",
                f"prompt: {len(ids)} tokens leave no room to generate within max_seq_len "
                f"({max_seq_len})",
                max_seq_len,
                len(ids),
                params.max_tokens,
            )
        if len(ids) + params.max_tokens > max_seq_len:
            raise ContextLengthError(
                "max_tokens",
                f"max_tokens: prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) "
                f"exceeds max_seq_len ({max_seq_len})",
                max_seq_len,
                len(ids),
                params.max_tokens,
            )
        _check(
            len(ids) + 1 <= self.max_seq_tokens,
            "prompt",
            f"prompt: {len(ids)} tokens + 1 cannot fit in the KV cache "
            f"({self.max_seq_tokens} tokens a sequence)",
        )
        vocab = self.model_config.vocab_size
        named = {"logit_bias": params.logit_bias, "stop_token_ids": params.stop_token_ids}
        for field, ids_named in named.items():
            _check(
                all(t < vocab for t in ids_named or ()),
                field,
                f"{field}: token ids must be in [0, {vocab})",
            )

    def _choices(
        self,
        asked: PromptRequest,
        params: SamplingParams,
        beam: BeamSearchParams | None,
        prompt_ids: list[int],
        spans: Spans,
        adapter: LoRARequest | None,
    ) -> Request:
        """The request's group: its n choices (or beams), each with a seed of its own and
        its own grammar matcher; the first leads."""
        # compiled (or found in the cache) before queueing: a bad spec is the caller's error
        structured = params.structured
        matcher = None if structured is None else self.grammars.matcher(structured)
        seed = params.seed if params.seed is not None else int(self._rng.integers(SEED_MAX + 1))
        eos = self.model_config.eos_token_ids
        search = None
        if beam is not None:
            search = BeamSearch(
                beam, eos, self.model_config.vocab_size, self._stop_check(prompt_ids, beam.stop)
            )

        def make_choice(i: int, request_id: str | None, arrival: float | None) -> Request:
            return Request(
                prompt_ids,
                params,
                eos,
                request_id,
                i,
                choice_seed(seed, i),
                adapter,
                priority=asked.priority,
                timeout_s=asked.timeout_s,
                pooling=asked.pooling,
                # each choice feeds its own matcher
                matcher=matcher if i == 0 or matcher is None else matcher.deep_copy(),
                beam=search,
                arrival=arrival,
                images=spans,
            )

        req = make_choice(0, asked.request_id, None)
        req.group += [make_choice(i, req.id, req.arrival) for i in range(1, params.n)]
        for choice in req.group:
            choice.group = req.group
        return req

    def _pixels(self, index: int, image: Any) -> np.ndarray:
        """One image's pixel values, float32 [3, H, W] as the checkpoint's processor
        makes them."""
        p = self.processing
        if isinstance(image, np.ndarray):
            if image.shape != (3, p.height, p.width):
                raise RequestError(
                    "images",
                    f"images[{index}]: pixel arrays must be [3, {p.height}, {p.width}], "
                    f"got {list(image.shape)}",
                )
            return image.astype(np.float32)
        from PIL import Image

        if not isinstance(image, Image.Image):
            raise RequestError(
                "images", f"images[{index}]: a PIL image or a pixel array, not {type(image)}"
            )
        return preprocess([image], p)[0]

    @property
    def image_placeholder(self) -> str | None:
        """The text an image stands as in a prompt (`<start_of_image>`); None: the model
        takes no images."""
        if self.vision is None:
            return None
        boi = self.tokenizer.convert_ids_to_tokens(self.vision.boi_token_id)
        return boi if isinstance(boi, str) else None

    def tokenize(
        self, text: str, add_special_tokens: bool = True, images: bool = False
    ) -> list[int]:
        """A text prompt's token ids (every text the engine runs is tokenized here);
        `images`: its image placeholders expanded first (`expand`)."""
        text = self.expand(text) if images else text
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def expand(self, prompt: str) -> str:
        """Each `<start_of_image>` of a text prompt as transformers' Gemma 3 processor
        expands it: the image's tokens between blank lines."""
        assert self.vision is not None
        boi, eoi, image = self.tokenizer.convert_ids_to_tokens(
            [self.vision.boi_token_id, self.vision.eoi_token_id, self.vision.image_token_id]
        )
        if not all(isinstance(t, str) for t in (boi, eoi, image)):
            raise RequestError("images", "images: the tokenizer lacks the image tokens")
        run = f"\n\n{boi}{image * self.vision.mm_tokens_per_image}{eoi}\n\n"
        return prompt.replace(boi, run)

    def discard(self, request: Request) -> None:
        """Give back what `prepare` took for a request that will not be added (refused,
        or its caller gone first)."""
        if request.holds_lora and self.loras is not None:
            request.holds_lora = False
            self.loras.unhold(request.lora)  # type: ignore[arg-type]

    def _stop_check(
        self, prompt_ids: list[int], stops: list[str]
    ) -> Callable[[list[int]], bool] | None:
        """Whether output ids hold a stop string, their text decoded after the prompt's
        last tokens as the output processor decodes it (a leading space stays)."""
        if not stops:
            return None
        context = prompt_ids[-DETOKENIZE_CONTEXT:]
        head = len(self.tokenizer.decode(context, skip_special_tokens=True))

        def stopped(ids: list[int]) -> bool:
            text = self.tokenizer.decode(context + ids, skip_special_tokens=True)[head:]
            return any(s in text for s in stops)

        return stopped
