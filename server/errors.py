"""Errors in OpenAI's shape: `{"error": {message, type, param, code}}`."""

from __future__ import annotations

import dataclasses
import re

from starlette.responses import JSONResponse

from jpaged.engine.sampling import SamplingParams

# Fields an engine ValueError may start with ("max_tokens: ...", "prompt must ...").
FIELDS = frozenset({"prompt", *(f.name for f in dataclasses.fields(SamplingParams))})

_NULLABLE = {"type": ["string", "null"]}
_FIELDS_SCHEMA = {"message": {"type": "string"}, "type": {"type": "string"}, "param": _NULLABLE,
                  "code": _NULLABLE}  # fmt: skip
# the body of every error response, as /openapi.json publishes it
ERROR_SCHEMA = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": list(_FIELDS_SCHEMA), "properties": _FIELDS_SCHEMA}}}  # fmt: skip


class APIError(Exception):
    def __init__(
        self, status: int, message: str, param: str | None = None,
        kind: str = "invalid_request_error", code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind
        self.code, self.headers = code, headers

    def response(self) -> JSONResponse:
        error = {"message": self.message, "type": self.kind, "param": self.param,
                 "code": self.code}  # fmt: skip
        return JSONResponse({"error": error}, status_code=self.status, headers=self.headers)


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


def engine_error(exc: ValueError, rename: dict[str, str]) -> APIError:
    """The engine's ValueError (its message starts with the offending field) as a 400
    whose `param` names that field as the request called it (`rename`: engine -> request)."""
    message = str(exc)
    m = re.match(r"[a-z_]+", message)
    param = m.group() if m and m.group() in FIELDS else None
    return APIError(400, message, rename.get(param, param) if param else None)
