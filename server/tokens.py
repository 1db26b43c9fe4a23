"""`POST /tokenize` and `POST /detokenize` in vLLM's shapes: token counting for clients
that budget their context (a prompt, or messages rendered by the chat template)."""

from __future__ import annotations

from typing import Any

from server.errors import APIError
from server.parse import Parser


def schemas(chat: dict, vocab: int) -> dict[str, dict]:
    """The request schemas of both routes (`chat`: ChatCompletionRequest's, whose messages
    and tools they take; `vocab`: the model's vocabulary size)."""
    ids = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": vocab - 1}}
    return {
        "TokenizeRequest": {
            "type": "object",
            "required": [],
            "description": "give prompt or messages",
            "properties": {
                "model": {"type": "string"},
                "prompt": {"type": "string"},
                "messages": chat["properties"]["messages"],
                "add_special_tokens": {
                    "type": "boolean",
                    "description": "the tokenizer's BOS (default: true with prompt, false "
                    "with messages, whose template writes its own)",
                },
                "add_generation_prompt": {"type": "boolean", "default": True},
                "chat_template_kwargs": {"type": "object"},
                "tools": chat["properties"]["tools"],
                "return_token_strs": {"type": "boolean", "default": False},
            },
        },
        "DetokenizeRequest": {
            "type": "object",
            "required": ["tokens"],
            "properties": {"model": {"type": "string"}, "tokens": ids},
        },
    }


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
    tokens = list(tokenizer.encode(text, add_special_tokens=bool(special)))
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
