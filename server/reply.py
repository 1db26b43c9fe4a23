"""An assistant's text -> its chat message: thinking (`reasoning_content`, and vLLM's newer
`reasoning`), answer (`content`) and tool calls, whole or as a stream's deltas in OpenAI's
shape."""

from __future__ import annotations

import secrets
import string
import uuid
from dataclasses import dataclass
from typing import Any

from server import reasoning, tools


@dataclass(frozen=True)
class Parsing:
    """How a request's outputs are read: which reasoning parser, which tool-call format
    (`tools.parse`'s), the function a named tool_choice forces, whether calls may be
    several."""

    reasoning: str | None = None
    tools: str | None = None
    function: str | None = None
    parallel: bool = True


_ALNUM = string.ascii_letters + string.digits


def call_id(fmt: str | None = None) -> str:
    """A tool call's id: OpenAI's shape, or for `mistral` nine letters and digits (Mistral's
    chat templates refuse any other id when the call comes back in the conversation)."""
    if fmt == "mistral":
        return "".join(secrets.choice(_ALNUM) for _ in range(9))
    return f"call_{uuid.uuid4().hex[:24]}"


class Reply:
    """One choice's message, built from its text as the text grows."""

    def __init__(self, parsing: Parsing) -> None:
        self.parsing = parsing
        self.text = ""
        self.sent_thought = self.sent_content = 0
        self.sent_calls: list[tuple[str, int]] = []  # streamed calls: id, arguments sent
        # whether the latest parse holds calls: a call whose JSON broke is content again at
        # the end, and the stream then ends as the whole answer would (not "tool_calls")
        self.calls = False

    def parts(self, final: bool) -> tuple[str, str, list[tools.ToolCall]]:
        """(thinking, answer, calls) of the text so far."""
        p = self.parsing
        thought, answer = (
            reasoning.split(p.reasoning, self.text, final) if p.reasoning else ("", self.text)
        )
        if p.tools is None:
            return thought, answer, []
        parsed = tools.parse(p.tools, answer, final, p.function)
        calls = parsed.calls if p.parallel else parsed.calls[:1]
        return thought, parsed.content, calls

    def message(self, text: str) -> tuple[dict[str, Any], bool]:
        """The whole message of `text`, and whether it calls tools."""
        self.text = text
        thought, answer, calls = self.parts(final=True)
        message: dict[str, Any] = {"role": "assistant", "content": answer}
        if self.parsing.reasoning:
            # vLLM's newer name beside the older one clients still read
            message["reasoning_content"] = message["reasoning"] = thought or None
        if calls:
            message["content"] = answer.strip() or None
            message["tool_calls"] = [
                {
                    "id": call_id(self.parsing.tools),
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments},
                }
                for c in calls
            ]
        return message, bool(calls)

    def delta(self, piece: str, final: bool) -> dict[str, Any]:
        """What `piece`, the text that came after the last delta, adds (maybe nothing)."""
        self.text += piece
        thought, answer, calls = self.parts(final)
        self.calls = bool(calls)
        delta: dict[str, Any] = {}
        if thought[self.sent_thought :]:
            delta["reasoning_content"] = delta["reasoning"] = thought[self.sent_thought :]
            self.sent_thought = len(thought)
        if answer[self.sent_content :]:
            delta["content"] = answer[self.sent_content :]
            self.sent_content = len(answer)
        pieces = []
        for i, call in enumerate(calls):
            if call.name is None:
                break  # its name comes first
            new = i == len(self.sent_calls)
            if new:
                self.sent_calls.append((call_id(self.parsing.tools), 0))
            ident, sent = self.sent_calls[i]
            more = call.arguments[sent:]
            self.sent_calls[i] = ident, max(sent, len(call.arguments))
            if new:  # OpenAI's order: the id and name, then the arguments in pieces
                function = {"name": call.name, "arguments": more}
                pieces.append({"index": i, "id": ident, "type": "function", "function": function})
            elif more:
                pieces.append({"index": i, "function": {"arguments": more}})
        if pieces:
            delta["tool_calls"] = pieces
        return delta

    def finish_reason(self, reason: str | None, called: bool) -> str | None:
        """OpenAI's finish_reason of a choice that ended for `reason` and made tool calls
        (`called`): "tool_calls", except for a named tool_choice, whose call is the whole
        answer ("stop", as OpenAI and vLLM give it)."""
        forced = self.parsing.tools == "named"
        return "tool_calls" if called and reason == "stop" and not forced else reason
