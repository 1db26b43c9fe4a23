"""Engine outputs -> OpenAI's response JSON (`text_completion`, `chat.completion`, their
chunks) and Server-Sent Events."""

from __future__ import annotations

import itertools
import json
import time
from typing import Any

from jpaged.engine.output import RequestOutput
from server.reply import Parsing, Reply


def sse(payload: dict | str) -> str:
    """One Server-Sent Event: `data: {json}` (or a literal such as `[DONE]`)."""
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


class Formatter:
    """RequestOutputs -> OpenAI `text_completion` / `chat.completion` JSON (and chunks).

    Outputs come numbered as the answer's choices: with a batch of prompts, prompt-major
    (`index = prompt * n + choice`). `echo`: each prompt's text, which its choices' text
    starts with (and, with logprobs, their tokens with the prompt's)."""

    def __init__(
        self,
        rid: str,
        model: str,
        chat: bool,
        logprobs: bool,
        n: int = 1,
        echo: list[str] | None = None,
        parsing: Parsing | None = None,
    ) -> None:
        self.rid, self.model, self.chat, self.logprobs = rid, model, chat, logprobs
        self.n, self.echo, self.parsing = n, echo, parsing or Parsing()
        self.replies: dict[int, Reply] = {}  # chat streams: each choice's message so far
        self.created = int(time.time())
        self.offsets: dict[int, int] = {}  # by choice: characters sent (text_offset)
        self.role_sent: set[int] = set()  # choices whose first chat delta went out
        self.echoed: set[int] = set()  # choices whose prompt went out

    def _envelope(self, obj: str, choices: list[dict]) -> dict:
        return {
            "id": self.rid,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def _usage(self, lasts: list[RequestOutput]) -> dict:
        """Token counts over every choice's last output (each prompt counted once)."""
        prompt = sum(o.prompt_tokens for o in lasts if o.index % self.n == 0)
        completion = sum(o.completion_tokens for o in lasts)
        usage: dict = {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }
        drafts = sum(o.num_draft_tokens for o in lasts)
        if drafts:  # speculative decoding, in OpenAI's names for predicted outputs
            accepted = sum(o.num_accepted_tokens for o in lasts)
            usage["completion_tokens_details"] = {
                "accepted_prediction_tokens": accepted,
                "rejected_prediction_tokens": drafts - accepted,
            }
        return usage

    def _text(self, index: int, text: str) -> str:
        """`text`, after the choice's prompt when that is echoed and has not gone out yet."""
        if self.echo is None or index in self.echoed:
            return text
        self.echoed.add(index)
        return self.echo[index // self.n] + text

    def _tokens(self, outs: list[RequestOutput]) -> list[tuple[str, float | None, dict | None]]:
        result: list[tuple[str, float | None, dict | None]] = []
        for out in outs:
            # a choice's first output carries its prompt's logprobs when echo asked for them
            if self.echo is not None and out.prompt_token_texts is not None:
                assert out.prompt_logprobs is not None
                tops: list[Any] = out.prompt_top_logprobs or [None] * len(out.prompt_logprobs)
                result.extend(zip(out.prompt_token_texts, out.prompt_logprobs, tops, strict=True))
            tops = out.top_logprobs or [None] * len(out.token_ids)
            assert out.tokens is not None  # the request asked for logprobs
            result.extend(zip(out.tokens, out.logprobs, tops, strict=True))
        return result

    def _logprobs(self, outs: list[RequestOutput]) -> dict | None:
        if not self.logprobs:
            return None
        tokens = self._tokens(outs)
        if self.chat:

            def entry(tok: str, lp: float | None) -> dict:
                return {"token": tok, "logprob": lp, "bytes": list(tok.encode())}

            return {
                "content": [
                    {
                        **entry(tok, lp),
                        "top_logprobs": [entry(t, v) for t, v in (top or {}).items()],
                    }
                    for tok, lp, top in tokens
                ]
            }
        index = outs[0].index if outs else 0
        offsets = list(
            itertools.accumulate((len(t) for t, _, _ in tokens), initial=self.offsets.get(index, 0))
        )
        self.offsets[index] = offsets.pop()
        return {
            "tokens": [tok for tok, _, _ in tokens],
            "token_logprobs": [lp for _, lp, _ in tokens],
            # like vLLM: the chosen token is always among its alternatives; a prompt's first
            # token has neither
            "top_logprobs": [
                None if lp is None else {**(top or {}), tok: lp} for tok, lp, top in tokens
            ],
            "text_offset": offsets,
        }

    def full(self, outs: list[RequestOutput], choices: int) -> dict:
        """The answer from every output of its `choices` choices."""
        by_choice: list[list[RequestOutput]] = [[] for _ in range(choices)]
        for out in outs:
            by_choice[out.index].append(out)
        listed, lasts = [], []
        for index, mine in enumerate(by_choice):
            text = self._text(index, "".join(o.text for o in mine))
            lasts.append(mine[-1])
            choice: dict[str, Any] = {
                "index": index,
                "logprobs": self._logprobs(mine),
                "finish_reason": mine[-1].finish_reason,
            }
            if self.chat:
                reply = Reply(self.parsing)
                choice["message"], called = reply.message(text)
                choice["finish_reason"] = reply.finish_reason(mine[-1].finish_reason, called)
            else:
                choice["text"] = text
            listed.append(choice)
        obj = "chat.completion" if self.chat else "text_completion"
        return {**self._envelope(obj, listed), "usage": self._usage(lasts)}

    def chunk(self, out: RequestOutput) -> dict | None:
        """The chunk of `out`; None when it adds nothing yet (text a parser holds back)."""
        reason = out.finish_reason if out.finished else None
        choice: dict[str, Any] = {
            "index": out.index,
            "logprobs": self._logprobs([out]),
            "finish_reason": reason,
        }
        if self.chat:
            reply = self.replies.setdefault(out.index, Reply(self.parsing))
            delta = reply.delta(out.text, out.finished)
            if out.index not in self.role_sent:
                text = {} if "tool_calls" in delta else {"content": ""}
                delta = {"role": "assistant", **text, **delta}
                self.role_sent.add(out.index)
            elif not (delta or out.finished or choice["logprobs"]):
                return None
            choice["delta"] = delta
            choice["finish_reason"] = reason and reply.finish_reason(reason, reply.calls)
        else:
            choice["text"] = self._text(out.index, out.text)
        return self._envelope("chat.completion.chunk" if self.chat else "text_completion", [choice])

    def usage_chunk(self, lasts: list[RequestOutput]) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._envelope(obj, []), "usage": self._usage(lasts)}
