"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}}, for every failure
the server answers, its own and the framework's (bad JSON, unknown routes), never a traceback."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

log = logging.getLogger("pagechat.server")

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error"}


@dataclass(slots=True)
class APIError(Exception):
    """A request the server refuses: the HTTP status, one line for the user, the parameter at
    fault and OpenAI's error code where one fits."""

    status: int
    message: str
    param: str | None = None
    code: str | None = None

    def body(self) -> dict:
        kind = _TYPES.get(
            self.status, "server_error" if self.status >= 500 else "invalid_request_error"
        )
        error = {"message": self.message, "type": kind, "param": self.param, "code": self.code}
        return {"error": error}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def bad_param(param: str, message: str, code: str | None = None) -> APIError:
    """A 400 that names the parameter at fault."""
    return APIError(400, message, param, code)


def _loc(loc: tuple) -> str | None:
    """A validation error's location as a parameter path: ('body', 'messages', 0, 'role') ->
    'messages[0].role'."""
    path = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        path += f"[{part}]" if isinstance(part, int) else f".{part}" if path else str(part)
    return path or None


def _common_prefix(locs: list[tuple]) -> tuple:
    first = locs[0]
    n = next(
        (i for i in range(len(first)) if any(loc[i : i + 1] != first[i : i + 1] for loc in locs)),
        len(first),
    )
    return first[:n]


def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    """The first field at fault as a 400. A union field fails once per member type (loc ends in
    the type's name): their common location names the field, their messages join."""
    errors = exc.errors()
    first = errors[0]
    if first.get("type") == "json_invalid":
        why = (first.get("ctx") or {}).get("error") or first.get("msg")
        return APIError(400, f"the request body is not valid JSON: {why}").response()
    field_errors = [e for e in errors if tuple(e["loc"][:2]) == tuple(first["loc"][:2])]
    param = _loc(_common_prefix([tuple(e["loc"]) for e in field_errors]))
    messages = list(dict.fromkeys(str(e.get("msg", "invalid value")) for e in field_errors))
    where = f"{param}: " if param else "the request body: "
    return APIError(400, where + ", or ".join(messages), param).response()


def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    detail = exc.detail if isinstance(exc.detail, str) else "request refused"
    if exc.status_code == 404:
        detail = f"no route {request.method} {request.url.path} (see GET /v1/models)"
    elif exc.status_code == 405:
        detail = f"{request.url.path} does not take {request.method}"
    return APIError(exc.status_code, detail).response()


def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.exception("internal error answering %s %s", request.method, request.url.path)
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}").response()


def install_error_handlers(app: FastAPI) -> None:
    """Answer every error in OpenAI's shape: ours, validation (400, never a 422 dump), routing."""
    app.add_exception_handler(APIError, lambda request, exc: exc.response())
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected)
