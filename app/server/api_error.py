"""The error every route raises for a request it cannot serve: an HTTP status and an
OpenAI-style body (``{"error": {"message", "type", "param", "code"}}``) naming what was
wrong, so a client gets one readable line and never a traceback."""

from __future__ import annotations


class ApiError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None,
                 type_: str = "invalid_request_error", retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param, self.type = status, message, code, param, type_
        self.retry_after_s = retry_after_s
        """Sent as ``Retry-After`` (a 503 that passes: clients' retry logic reads it)."""

    def headers(self) -> dict[str, str]:
        return {} if self.retry_after_s is None else {"Retry-After": str(self.retry_after_s)}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def shutting_down() -> ApiError:
    return ApiError(503, "The server is shutting down; retry against its next start.", "shutting_down",
                    type_="server_error")


def superseded() -> ApiError:
    return ApiError(499, "Cancelled: the same client sent a newer /infill.", "superseded")


def cancelled() -> ApiError:
    return ApiError(499, "Request cancelled.", "cancelled")
