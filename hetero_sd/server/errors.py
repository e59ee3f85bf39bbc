"""Errors in OpenAI's shape, {"error": {"message", "type", "param", "code"}}, for every failure: a bad
request names the field; nothing answers with a traceback (the last handler catches everything)."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from hetero_sd.errors import HeteroSDError, InvalidArgumentError, PromptTooLongError

log = logging.getLogger("hetero_sd.server")

TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
         405: "invalid_request_error", 408: "invalid_request_error", 413: "invalid_request_error",
         429: "rate_limit_error", 503: "service_unavailable"}


FIELDS = {"temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty", "presence_penalty",
          "frequency_penalty", "max_tokens", "stop", "messages", "prompt", "chat_template_kwargs"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": TYPES.get(status, "server_error"), "param": param, "code": code}}


def respond(status: int, message: str, param: str | None = None, code: str | None = None, headers=None):
    return JSONResponse(body(status, message, param, code), status_code=status, headers=headers)


def from_hetero(e: HeteroSDError) -> ApiError:
    """The runtime's own checks (validate.py) name the value; they become 400s (500 for the rest)."""
    if isinstance(e, PromptTooLongError):
        return ApiError(400, f"{e.problem}; {e.fix}", "messages", "context_length_exceeded")
    if isinstance(e, InvalidArgumentError):
        param = e.problem.split(" ", 1)[0]  # validate.py's messages start with the argument's name
        return ApiError(400, f"{e.problem}; {e.fix}", param if param in FIELDS else None, "invalid_value")
    return ApiError(500, f"{e.problem}; {e.fix}", None, type(e).__name__)


def validation_message(err: dict) -> tuple[str, str | None]:
    """One pydantic error as (message, param): the field's dotted path and what was wrong with it."""
    loc = [str(p) for p in err.get("loc", ()) if p != "body"]
    if err.get("type") == "json_invalid":
        return f"the body is not valid JSON ({err.get('ctx', {}).get('error', err.get('msg'))})", None
    if err.get("type") == "extra_forbidden":
        return f"unknown or unsupported field {'.'.join(loc)!r}; remove it", loc[0] if loc else None
    if err.get("type") == "missing" and not loc:
        return "the body is missing: send a JSON object", None
    # A union's errors carry its member type in the path (e.g. temperature.float); keep the field names.
    names = [p for p in loc if not (p in ("str", "int", "float", "list[int]", "list[str]", "bool", "dict")
                                   or p.startswith(("list[", "function-", "constrained-", "literal[")))]
    field = ".".join(names) or None
    value = err.get("input")
    shown = "" if isinstance(value, (dict, list)) and len(repr(value)) > 80 else f" (got {value!r})"
    return f"{field or 'body'}: {err.get('msg')}{shown}", names[0] if names else None


def install(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        extra = [e for e in errors if e.get("type") == "extra_forbidden"]
        message, param = validation_message((extra or errors)[0] if errors else {})
        if len(extra) > 1:
            names = ", ".join(repr(".".join(str(p) for p in e["loc"] if p != "body")) for e in extra)
            message = f"unknown or unsupported fields {names}; remove them"
        return respond(400, message, param, "invalid_value" if not extra else "unknown_field")

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError):
        return respond(exc.status, exc.message, exc.param, exc.code,
                       {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        code = {408: "request_timeout", 413: "request_too_large"}.get(exc.status_code)  # limits.py
        return respond(exc.status_code, str(exc.detail), None, code, exc.headers)

    @app.exception_handler(HeteroSDError)
    async def hetero(request: Request, exc: HeteroSDError):
        e = from_hetero(exc)
        return respond(e.status, e.message, e.param, e.code)

    @app.exception_handler(Exception)
    async def anything(request: Request, exc: Exception):
        log.exception("unexpected error on %s", request.url.path)  # the trace goes to the log, not the client
        return respond(500, f"internal error: {type(exc).__name__}: {exc}", None, "internal_error")
