"""Errors in OpenAI's shape: `{"error": {message, type, param, code}}`."""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from jpaged.engine.sampling import ContextLengthError, RequestError

_NULLABLE = {"type": ["string", "null"]}
_FIELDS_SCHEMA = {
    "message": {"type": "string"},
    "type": {"type": "string"},
    "param": _NULLABLE,
    "code": _NULLABLE,
}
# the body of every error response, as /openapi.json publishes it
ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {"type": "object", "required": list(_FIELDS_SCHEMA), "properties": _FIELDS_SCHEMA}
    },
}


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        kind: str = "invalid_request_error",
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind
        self.code, self.headers = code, headers

    def response(self) -> JSONResponse:
        error = {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}
        return JSONResponse({"error": error}, status_code=self.status, headers=self.headers)


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


Handler = Callable[[Request], Awaitable[Response]]


def answers_errors(handler: Handler) -> Handler:
    """`handler`, an APIError it raises answered in OpenAI's shape, and a client that left
    before its answer answered 499 (nginx's "client closed"; nobody reads it)."""

    @functools.wraps(handler)
    async def answering(request: Request) -> Response:
        try:
            return await handler(request)
        except APIError as exc:
            return exc.response()
        except ClientGone:
            return Response(status_code=499)

    return answering


def engine_error(exc: ValueError, rename: dict[str, str], prompt: int | None = None) -> APIError:
    """The engine's ValueError as a 400 whose `param` names the offending field as the
    request called it (`rename`: engine -> request); `prompt`: which of a batch it was.
    A prompt longer than the context is OpenAI's `context_length_exceeded`, in its words."""
    field = exc.field if isinstance(exc, RequestError) else None
    where = "" if prompt is None else f" (prompt[{prompt}] of the batch)"
    if isinstance(exc, ContextLengthError):
        param = rename.get("prompt", "prompt")  # the prompt's field, whichever overflowed
        message = context_length_message(
            exc.max_seq_len, exc.prompt_tokens, exc.max_tokens, param == "messages"
        )
        return APIError(400, f"{message}{where}", param, code="context_length_exceeded")
    return APIError(400, f"{exc}{where}", rename.get(field, field) if field else None)


def context_length_message(context: int, prompt: int, completion: int, chat: bool) -> str:
    """OpenAI's words (as vLLM answers them) for a prompt and max_tokens over the context."""
    head = (
        f"This model's maximum context length is {context} tokens. However, you requested "
        f"{prompt + completion} tokens "
    )
    if chat:
        return (
            f"{head}({prompt} in the messages, {completion} in the completion). "
            "Please reduce the length of the messages or completion."
        )
    return (
        f"{head}({prompt} in your prompt; {completion} for the completion). "
        "Please reduce the length of the prompt or completion."
    )
