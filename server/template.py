"""Chat templates: an OpenAI conversation (tools, tool calls and their results included)
-> the prompt's text.

The checkpoint's own jinja template (Hugging Face `chat_template`, GGUF
`tokenizer.chat_template`) or `--chat-template FILE` renders it through transformers'
`apply_chat_template`: the renderer the templates are written for (its sandbox, `tojson`,
`raise_exception`, the special tokens as variables). As vLLM does, an assistant's
`tool_calls[].function.arguments` (a JSON string in OpenAI's API) reach the template as
the object they encode, which templates print with `tojson`.
"""

from __future__ import annotations

import inspect
import json
from typing import Any

from server.errors import APIError


class Template:
    def __init__(self, tokenizer: Any, source: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.source = source or getattr(tokenizer, "chat_template", None)
        # template variables a request may not set: the renderer's own arguments
        self.reserved = {"messages", "conversations"} | set(
            inspect.signature(tokenizer.apply_chat_template).parameters
        )

    def render(
        self,
        messages: list[dict],
        tools: list[dict] | None = None,
        add_generation_prompt: bool = True,
        variables: dict[str, Any] | None = None,
        image: str = "",
    ) -> str:
        """The prompt text of `messages` (OpenAI's shape); `variables`: the request's
        chat_template_kwargs; `image`: the text an image part becomes (the model's image
        placeholder, `<start_of_image>`). Raises an APIError naming the field at fault."""
        if not self.source:
            raise APIError(
                400,
                "the model has no chat template (start the server with --chat-template)",
                "messages",
            )
        variables = variables or {}
        clash = sorted(self.reserved & set(variables))
        if clash:
            raise APIError(
                400, f"chat_template_kwargs may not set {', '.join(clash)}", "chat_template_kwargs"
            )
        try:
            return self.tokenizer.apply_chat_template(
                [_message(m, i, image) for i, m in enumerate(messages)],
                tools=tools,
                chat_template=self.source,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
                **variables,
            )
        except APIError:
            raise
        except Exception as exc:  # the template's own raise_exception(): bad roles, order
            raise APIError(400, f"messages: chat template failed: {exc}", "messages") from None


def _message(message: dict, index: int, image: str = "") -> dict:
    """`message` as templates expect it: text content (an image part the placeholder
    `image`), tool-call arguments as objects."""
    out = {k: v for k, v in message.items() if v is not None}
    if out.get("role") == "developer":  # OpenAI's newer name; templates know only system
        out["role"] = "system"
    content = out.get("content")
    if isinstance(content, list):  # OpenAI's content parts
        out["content"] = "".join(image if p["type"] == "image_url" else p["text"] for p in content)
    elif content is None:  # an assistant turn of tool calls; templates read content anyway
        out["content"] = ""
    calls = []
    for j, call in enumerate(out.get("tool_calls") or []):
        function = dict(call["function"])
        if isinstance(function.get("arguments"), str):
            try:
                function["arguments"] = json.loads(function["arguments"])
            except ValueError:
                field = f"messages[{index}].tool_calls[{j}].function.arguments"
                raise APIError(400, f"{field} is not JSON", "messages") from None
        calls.append({**call, "function": function})
    if calls:
        out["tool_calls"] = calls
    return out
