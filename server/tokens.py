"""`POST /tokenize` and `POST /detokenize` in vLLM's shapes: token counting for clients
that budget their context (a prompt, or messages rendered by the chat template)."""

from __future__ import annotations

from typing import Any

from server.errors import APIError
from server.parse import Parser


def tokenize(parser: Parser, body: dict) -> dict[str, Any]:
    args = parser.check(body, "TokenizeRequest")
    tokenizer = parser.tokenizer
    if (args["prompt"] is None) == (args["messages"] is None):
        raise APIError(400, "give prompt or messages (one of them)", "prompt")
    special = args["add_special_tokens"]
    if args["prompt"] is not None:
        text = args["prompt"]
        special = True if special is None else special
    else:
        text = parser.template.render(
            args["messages"],
            args["tools"],
            args["add_generation_prompt"],
            args["chat_template_kwargs"],
        )
    tokens = parser.engine.tokenize(text, bool(special))
    strs = tokenizer.convert_ids_to_tokens(tokens) if args["return_token_strs"] else None
    return {
        "count": len(tokens),
        "max_model_len": parser.max_seq_len,
        "tokens": tokens,
        "token_strs": strs,
    }


def detokenize(parser: Parser, body: dict) -> dict[str, Any]:
    args = parser.check(body, "DetokenizeRequest")
    return {"prompt": parser.tokenizer.decode(args["tokens"])}
