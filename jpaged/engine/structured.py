"""Structured outputs: grammars compiled by llguidance, one matcher per constrained choice.

llguidance (the grammar backend vLLM offers beside xgrammar) turns a JSON schema, a
regular expression, a choice or a Lark/GBNF grammar into a matcher that, given the
tokens so far, writes the allowed next tokens as a packed bitmask (32 tokens an int32
word) straight into a NumPy array, which the jitted sampler applies. Chosen over
xgrammar on SmolLM2's vocabulary (benchmarks/RESULTS.md, "Structured outputs"): both
fill a row's mask in microseconds, but xgrammar's bitmasks are torch tensors and it
needs torch and triton at run time, which a JAX engine does not otherwise install.

A grammar is compiled (and checked against the tokenizer) once per distinct spec and
kept in a small LRU cache; each choice of a request gets its own deep copy of the
compiled matcher. llguidance's own tokenizer is built once per model, as its engine
starts: ~0.5 s for a 49k vocabulary, half of it holding the GIL (serializing the Hugging
Face tokenizer), which would stall every stream if a request's arrival built it.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np

from jpaged.engine.sampling import RequestError, StructuredOutputsParams

CACHE_SIZE = 256  # compiled grammars kept (distinct schemas, regexes, ...)
# Compact JSON: with any whitespace allowed, a small model may emit blank lines forever.
JSON_OPTIONS = {"whitespace_flexible": False}


# Hugging Face tokenizer -> llguidance's (every engine of one model shares it)
_tokenizers: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
_tokenizers_lock = threading.Lock()


def mask_words(vocab: int) -> int:
    """int32 words of one row's packed bitmask."""
    return (vocab + 31) // 32


class GrammarCompiler:
    """Compiles structured-output specs into matchers for one tokenizer (thread-safe:
    requests are prepared outside the engine thread)."""

    def __init__(self, tokenizer: Any, vocab: int, eos_ids: Sequence[int]) -> None:
        self._hf = tokenizer
        self.vocab = vocab
        self._eos = list(eos_ids)
        self._cache: collections.OrderedDict[tuple[str, str], Any] = collections.OrderedDict()
        self._lock = threading.Lock()
        # llguidance's tokenizer, built beside the engine's warm-up (`ready` waits for it)
        self._build = threading.Thread(target=self._prebuild, name="jpaged-grammar", daemon=True)
        self._build.start()

    def _prebuild(self) -> None:
        # a tokenizer llguidance cannot take fails the first structured request instead
        with contextlib.suppress(Exception):
            self._tokenizer()

    def ready(self) -> None:
        """Wait until llguidance's tokenizer is built."""
        self._build.join()

    def _tokenizer(self) -> Any:
        import llguidance.hf

        with _tokenizers_lock:
            built = _tokenizers.get(self._hf)
            if built is None:
                built = _tokenizers[self._hf] = llguidance.hf.from_tokenizer(
                    self._hf, n_vocab=self.vocab, eos_token=self._eos
                )
            return built

    def matcher(self, spec: StructuredOutputsParams) -> Any:
        """A fresh matcher for `spec`; RequestError naming the spec's field if the backend
        cannot compile it."""
        key = spec.key()
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is None:
                compiled = self._compile(spec)
                self._cache[key] = compiled
                if len(self._cache) > CACHE_SIZE:
                    self._cache.popitem(last=False)
            self._cache.move_to_end(key)
        return compiled.deep_copy()

    def _compile(self, spec: StructuredOutputsParams) -> Any:
        import llguidance

        tokenizer = self._tokenizer()
        kind = spec.kind
        field = f"structured.{kind}"
        try:
            if kind == "json":
                grammar = llguidance.LLMatcher.grammar_from_json_schema(
                    spec.json,  # type: ignore[arg-type]
                    defaults=JSON_OPTIONS,  # type: ignore[arg-type]
                )
            elif kind == "json_object":
                grammar = llguidance.LLMatcher.grammar_from_json_schema(
                    {"type": "object"},
                    defaults=JSON_OPTIONS,  # type: ignore[arg-type]
                )
            elif kind == "regex":
                grammar = llguidance.LLMatcher.grammar_from_regex(str(spec.regex))
            elif kind == "choice":
                grammar = llguidance.grammar_from("choice", spec.choice)  # type: ignore[arg-type]
            else:
                grammar = llguidance.grammar_from("grammar", str(spec.grammar))
        except (ValueError, TypeError) as e:
            raise RequestError(field, f"{field}: cannot compile: {e}") from None
        error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
        if error:
            raise RequestError(field, f"{field}: cannot compile: {error}")
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise RequestError(field, f"{field}: cannot compile: {matcher.get_error()}")
        return matcher


def fill_mask(matcher: Any, out: np.ndarray) -> None:
    """Write the tokens `matcher` allows next into `out` (int32 [mask_words(vocab)],
    C-contiguous); a matcher in an error state allows everything (its request ends)."""
    if matcher.is_error():
        out[:] = -1
        return
    matcher.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)
