"""HTTP errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

import re
from typing import Any

import msgspec

_PATH = re.compile(r" - at `\$(?P<path>[^`]*)`$")
_FIELD = re.compile(r"field `(?P<name>[^`]+)`")


class APIError(Exception):
    """An error a client caused or must handle; becomes a JSON error response with ``status``."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        type: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type or _TYPES.get(status, "server_error")
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def anthropic_body(self) -> dict[str, Any]:
        kind = _ANTHROPIC_TYPES.get(self.status, "api_error")
        return {"type": "error", "error": {"type": kind, "message": self.message}}


_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "invalid_request_error",  # a clash the client resolves: a session that exists or is busy, a model busy
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "overloaded_error",
}
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def unsupported(param: str, why: str) -> APIError:
    return APIError(400, f"{param}: {why}", param=param, code="unsupported_parameter")


def from_msgspec(error: msgspec.DecodeError) -> APIError:
    """A 400 naming the field msgspec rejected: ``Expected `int`, got `str` - at `$.max_tokens``` -> param max_tokens."""
    text = str(error)
    param = None
    match = _PATH.search(text)
    if match:
        param = match.group("path").lstrip(".") or None
        text = text[: match.start()]
    field = _FIELD.search(text)
    if field and ("missing required field" in text or "unknown field" in text):
        param = f"{param}.{field.group('name')}" if param else field.group("name")
    if param:
        text = f"{text} (at {param})"
    if isinstance(error, msgspec.ValidationError):
        return APIError(400, f"invalid request: {text}", param=param)
    return APIError(400, f"request body is not valid JSON: {text}", code="invalid_json")
