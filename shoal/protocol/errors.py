"""OpenAI error bodies for every failure the server reports, FastAPI's own included."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)

# Exit statuses a replica ends with, for its supervisor: its engine loop died (restart it), or it
# lost a rank of a tensor/pipeline-parallel model (restart it; no request is to blame).
EXIT_ENGINE_DEAD = 3
EXIT_RANK_LOST = 4
# The in-band error code of a request cut short by a lost rank: the gateway continues it elsewhere.
RANK_LOST_CODE = "rank_lost"
# The code of a 503 from a replica that is shutting down (SIGTERM): not a failure, send it elsewhere.
DRAINING_CODE = "draining"

TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    kind = TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def overloaded(message: str) -> APIError:
    return APIError(503, message, code="overloaded", headers={"Retry-After": "1"})


def validation_message(errors) -> tuple[str, str | None]:
    """(message, param) for pydantic's list of validation errors."""
    if not errors:
        return "invalid request body", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        return "the request body is not valid JSON", None
    msg = first.get("msg", "invalid value")
    cause = (first.get("ctx") or {}).get("error")
    if getattr(cause, "param", None):  # a validator's own error names its field
        param, msg = cause.param, str(cause)
        return msg, param
    more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
    return (f"{param}: {msg}{more}" if param else f"{msg}{more}"), param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError):
        message, param = validation_message(exc.errors())
        return JSONResponse(error_body(400, message, param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException):
        return JSONResponse(
            error_body(exc.status_code, str(exc.detail)), status_code=exc.status_code, headers=exc.headers
        )

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception):
        log.exception("unhandled error")
        return JSONResponse(error_body(500, f"internal error: {type(exc).__name__}"), status_code=500)
