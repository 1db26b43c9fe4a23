"""A model's thinking, kept apart from its answer (`--reasoning-parser`, vLLM's names).

`qwen3`: thinking is what the output writes inside `<think>...</think>` at its start;
an output that does not start with `<think>` is all answer (Qwen3 with
`enable_thinking: false`). `deepseek_r1`: the template opens `<think>` in the prompt, so
everything up to `</think>` is thinking, all of it if the tag never comes.

As with tool calls, a prefix's split is a prefix of the whole's: a partial tag at the end
is held back, and the answer's leading whitespace after `</think>` waits for its first
other character.
"""

from __future__ import annotations

from server.tools import held

PARSERS = ("qwen3", "deepseek_r1")
_OPEN, _CLOSE = "<think>", "</think>"


def split(parser: str, text: str, final: bool) -> tuple[str, str]:
    """(thinking, answer) of `text` (the whole output if `final`, else what has come)."""
    body = text.lstrip()
    if not final and _OPEN.startswith(body):
        return "", ""  # may yet open a thought
    if body.startswith(_OPEN):
        body = body[len(_OPEN) :]
    elif parser == "qwen3":
        return "", text
    end = body.find(_CLOSE)
    if end >= 0:
        return body[:end], body[end + len(_CLOSE) :].lstrip()
    return (body if final else body[: len(body) - held(body, _CLOSE)]), ""
