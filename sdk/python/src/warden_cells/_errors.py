"""Errors: the API's error body (`error`, `code`, `hint`) as exceptions."""

from __future__ import annotations

from typing import Any, Optional


class WardenError(Exception):
    """The daemon refused or failed a request: `status` (HTTP), `code` (the API's: bad-request,
    unauthorized, forbidden, not-found, conflict, too-large, unavailable, internal), `message`, `hint`, and
    `reason`, which failure within the code it is (`cell-paused`, `denied`, `no-such-process`,
    ...), where the daemon says."""

    def __init__(self, status: int, code: str, message: str, hint: Optional[str] = None,
                 reason: Optional[str] = None):
        self.status = status
        self.code = code
        self.message = message
        self.hint = hint
        self.reason = reason
        text = f"{message} ({code}, HTTP {status})"
        if hint:
            text += f"; {hint}"
        super().__init__(text)


class BadRequest(WardenError):
    """The request is malformed or names something that cannot be (400, 422)."""


class Unauthorized(WardenError):
    """The token is missing or wrong (401; the daemon's TCP listener only)."""


class Forbidden(WardenError):
    """A policy rule, or a person, refused it (403)."""


class NotFound(WardenError):
    """What it names does not exist (404)."""


class Conflict(WardenError):
    """It cannot be done in the cell's present state (409)."""


class TooLarge(WardenError):
    """Too large (413)."""


class Unavailable(WardenError):
    """The warden cannot do it now (503); try again."""


class ConnectionFailed(WardenError):
    """The daemon could not be reached (is `warden serve` running?)."""


_BY_CODE = {
    "bad-request": BadRequest,
    "unauthorized": Unauthorized,
    "forbidden": Forbidden,
    "not-found": NotFound,
    "conflict": Conflict,
    "too-large": TooLarge,
    "unavailable": Unavailable,
}


def error_of(status: int, body: Any) -> WardenError:
    """The exception for an answer that is not a success."""
    if isinstance(body, dict) and isinstance(body.get("error"), str):
        code = str(body.get("code") or "internal")
        cls = _BY_CODE.get(code, WardenError)
        return cls(status, code, body["error"], body.get("hint"), body.get("reason"))
    code = {400: "bad-request", 401: "unauthorized", 403: "forbidden", 404: "not-found",
            409: "conflict", 413: "too-large", 503: "unavailable"}.get(status, "internal")
    cls = _BY_CODE.get(code, WardenError)
    text = body if isinstance(body, str) else repr(body)
    return cls(status, code, text.strip() or f"HTTP {status}")
