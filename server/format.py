"""Engine outputs -> OpenAI's response JSON (`text_completion`, `chat.completion`, their
chunks) and Server-Sent Events."""

from __future__ import annotations

import itertools
import json
import time
from typing import Any

from jpaged.engine.output import RequestOutput


def sse(payload: dict | str) -> str:
    """One Server-Sent Event: `data: {json}` (or a literal such as `[DONE]`)."""
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


class Formatter:
    """RequestOutputs -> OpenAI `text_completion` / `chat.completion` JSON (and chunks)."""

    def __init__(self, rid: str, model: str, chat: bool, logprobs: bool) -> None:
        self.rid, self.model, self.chat, self.logprobs = rid, model, chat, logprobs
        self.created = int(time.time())
        self.offsets: dict[int, int] = {}  # by choice: characters sent (text_offset)
        self.role_sent: set[int] = set()  # choices whose first chat delta went out

    def _envelope(self, obj: str, choices: list[dict]) -> dict:
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model,
                "choices": choices}  # fmt: skip

    @staticmethod
    def _usage(lasts: list[RequestOutput]) -> dict:
        """Token counts over every choice's last output."""
        prompt, completion = lasts[0].prompt_tokens, sum(o.completion_tokens for o in lasts)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}  # fmt: skip

    def _tokens(self, outs: list[RequestOutput]) -> list[tuple[str, float, dict | None]]:
        result: list[tuple[str, float, dict | None]] = []
        for out in outs:
            tops: list[Any] = out.top_logprobs or [None] * len(out.token_ids)
            assert out.tokens is not None  # the request asked for logprobs
            result.extend(zip(out.tokens, out.logprobs, tops, strict=True))
        return result

    def _logprobs(self, outs: list[RequestOutput]) -> dict | None:
        if not self.logprobs:
            return None
        tokens = self._tokens(outs)
        if self.chat:
            def entry(tok: str, lp: float) -> dict:
                return {"token": tok, "logprob": lp, "bytes": list(tok.encode())}

            return {"content": [
                {**entry(tok, lp), "top_logprobs": [entry(t, v) for t, v in (top or {}).items()]}
                for tok, lp, top in tokens
            ]}  # fmt: skip
        index = outs[0].index if outs else 0
        offsets = list(itertools.accumulate((len(t) for t, _, _ in tokens),
                                            initial=self.offsets.get(index, 0)))  # fmt: skip
        self.offsets[index] = offsets.pop()
        return {
            "tokens": [tok for tok, _, _ in tokens],
            "token_logprobs": [lp for _, lp, _ in tokens],
            # like vLLM: the chosen token is always among its alternatives
            "top_logprobs": [{**(top or {}), tok: lp} for tok, lp, top in tokens],
            "text_offset": offsets,
        }

    def full(self, outs: list[RequestOutput], n: int = 1) -> dict:
        choices, lasts = [], []
        for index in range(n):
            mine = [o for o in outs if o.index == index]
            text = "".join(o.text for o in mine)
            lasts.append(mine[-1])
            choice: dict[str, Any] = {"index": index, "logprobs": self._logprobs(mine),
                                      "finish_reason": mine[-1].finish_reason}  # fmt: skip
            if self.chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            choices.append(choice)
        obj = "chat.completion" if self.chat else "text_completion"
        return {**self._envelope(obj, choices), "usage": self._usage(lasts)}

    def chunk(self, out: RequestOutput) -> dict:
        reason = out.finish_reason if out.finished else None
        choice: dict[str, Any] = {"index": out.index, "logprobs": self._logprobs([out]),
                                  "finish_reason": reason}  # fmt: skip
        if self.chat:
            delta = {"content": out.text}
            if out.index not in self.role_sent:
                delta = {"role": "assistant", **delta}
                self.role_sent.add(out.index)
            choice["delta"] = delta
        else:
            choice["text"] = out.text
        return self._envelope("chat.completion.chunk" if self.chat else "text_completion", [choice])

    def usage_chunk(self, lasts: list[RequestOutput]) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._envelope(obj, []), "usage": self._usage(lasts)}
