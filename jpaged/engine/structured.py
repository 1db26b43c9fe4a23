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
compiled matcher.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from jpaged.engine.sampling import RequestError, StructuredOutputsParams

CACHE_SIZE = 256  # compiled grammars kept (distinct schemas, regexes, ...)
# Compact JSON: with any whitespace allowed, a small model may emit blank lines forever.
JSON_OPTIONS = {"whitespace_flexible": False}


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
        self._tokenizer: Any = None  # llguidance's, built when first needed (~0.5 s)
        self._cache: collections.OrderedDict[tuple[str, str], Any] = collections.OrderedDict()
        self._lock = threading.Lock()

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
        import llguidance.hf

        if self._tokenizer is None:
            self._tokenizer = llguidance.hf.from_tokenizer(
                self._hf, n_vocab=self.vocab, eos_token=self._eos
            )
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
        error = llguidance.LLMatcher.validate_grammar(grammar, self._tokenizer)
        if error:
            raise RequestError(field, f"{field}: cannot compile: {error}")
        matcher = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
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
