"""`GET /openapi.json`: the OpenAPI 3.1 document of the app, its request bodies the
schemas of the models that validate them (`server.protocol`)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from server.errors import ERROR_SCHEMA
from server.protocol import published

DESCRIPTION = (
    "OpenAI-style HTTP API over an AsyncEngine: completions, chat, models, health, metrics."
)


# POST routes -> their request schema, and what they do
POSTS = {
    "/v1/completions": ("CompletionRequest", "complete a prompt"),
    "/v1/chat/completions": ("ChatCompletionRequest", "answer a conversation"),
    "/v1/responses": ("ResponsesRequest", "answer (OpenAI's Responses API, stateless)"),
    "/v1/embeddings": ("EmbeddingRequest", "embed texts or token lists"),
    "/tokenize": ("TokenizeRequest", "a prompt's or conversation's tokens (vLLM's)"),
    "/detokenize": ("DetokenizeRequest", "the text of tokens (vLLM's)"),
}


def openapi(models: dict[str, type[BaseModel]], secured: bool) -> dict:
    """The OpenAPI 3.1 document of the app: its routes, and its request bodies as validated
    (`models`: `protocol.request_models`')."""

    def ref(name: str) -> dict:
        return {"schema": {"$ref": f"#/components/schemas/{name}"}}

    error = {"description": "an error", "content": {"application/json": ref("Error")}}
    errors = {code: error for code in ("400", "401", "404", "405", "408", "413", "503")}
    key: dict[str, Any] = {"security": [{"bearer": []}]} if secured else {}

    def post(name: str, summary: str) -> dict:
        ok = {
            "description": "the answer; with stream: true, Server-Sent Events "
            "(`data: {chunk}` events, then `data: [DONE]`; /v1/responses: its own events)",
            "content": {
                "application/json": {"schema": {"type": "object"}},
                "text/event-stream": {"schema": {"type": "string"}},
            },
        }
        return {
            "post": {
                "summary": summary,
                "responses": {"200": ok, **errors},
                **key,
                "requestBody": {"required": True, "content": {"application/json": ref(name)}},
            }
        }

    def get(summary: str, media: str = "application/json", extra: dict | None = None) -> dict:
        body = {"type": "object" if media.endswith("json") else "string"}
        ok = {"description": summary, "content": {media: {"schema": body}}}
        return {"get": {"summary": summary, "responses": {"200": ok, **errors}, **(extra or {})}}

    return {
        "openapi": "3.1.0",
        "info": {"title": "jpaged", "version": "1", "description": DESCRIPTION},
        "paths": {
            **{p: post(name, what) for p, (name, what) in POSTS.items() if name in models},
            "/v1/models": get("the served model, under each of its ids", extra=key),
            "/v1/models/{model}": get(
                "a served model; any other id is a 404 (model_not_found)",
                extra={
                    **key,
                    "parameters": [
                        {
                            "name": "model",
                            "in": "path",
                            "required": True,
                            "schema": {"type": "string"},
                        }
                    ],
                },
            ),
            "/health": get("200 while the engine runs, 503 otherwise or while shutting down"),
            "/metrics": get("Prometheus text", "text/plain"),
            "/openapi.json": get("this document"),
        },
        "components": {
            "schemas": {**{k: published(m) for k, m in models.items()}, "Error": ERROR_SCHEMA},
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }
