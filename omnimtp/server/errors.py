"""The one error shape of the HTTP API: `APIError` leaves as an OpenAI-style body
`{"error": {"message", "type", "param", "code"}}` with its status (and headers)."""

from __future__ import annotations

import re

from fastapi.responses import JSONResponse
from pydantic import ValidationError

from omnimtp.server.requests import QueueFullError

# Not an HTTP status a client sees: the client is gone. It labels such requests in the metrics
# (nginx's "client closed request").
CLIENT_CLOSED = 499


class APIError(Exception):
    """An error that leaves the server as an OpenAI-style body with `status` (and `headers`)."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param=None, code=None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def queue_full(exc: QueueFullError) -> APIError:
    """A full queue's 429, with its Retry-After (and retry-after-ms, where the wait is known more finely)."""
    headers = {"Retry-After": str(exc.retry_after_s)}
    if exc.retry_after_ms is not None:
        headers["retry-after-ms"] = str(exc.retry_after_ms)
    return APIError(429, str(exc), type="rate_limit_exceeded", code="queue_full", headers=headers)


# The types of chat content parts: pydantic puts a part's type into the error location of its fields.
_PART_TYPES = ("text", "input_audio", "image_url")
# The member tags pydantic puts into the location of an error inside a union ("constrained-int",
# "literal['inf']", "function-after[...]", a model's class name): not fields the client sent.
_UNION_TAG = re.compile(r"(constrained-)?(int|float|str|bool|list|dict|bytes|none)|[a-z-]+\[.*\]|[A-Z]\w*")


def validation_error(exc: ValidationError) -> APIError:
    """A request body's first schema error as a 400 naming the field (`messages.0.content.1.input_audio.data`)."""
    first = exc.errors()[0]
    loc = first["loc"]
    # ("messages", 0, "content", 1, "input_audio", "input_audio", "data") → messages.0.content.1.input_audio.data
    loc = [part for k, part in enumerate(loc)
           if not (k >= 2 and loc[k - 2] == "content" and isinstance(loc[k - 1], int) and part in _PART_TYPES)]
    if first["type"] != "extra_forbidden":  # an unknown key is the client's own name, whatever it looks like
        loc = [part for part in loc if not (isinstance(part, str) and _UNION_TAG.fullmatch(part))]
    param = ".".join(str(part) for part in loc) or None
    message = f"{param}: {first['msg']}" if param else first["msg"]
    code = "missing_required_parameter" if first["type"] == "missing" else "invalid_value"
    if first["type"] == "extra_forbidden":
        message = f"Unrecognized request argument supplied: {param}"
        code = "unknown_parameter"
    return APIError(400, message, param=param, code=code)
