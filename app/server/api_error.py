"""The error every route raises for a request it cannot serve: an HTTP status and an
OpenAI-style body (``{"error": {"message", "type", "param", "code"}}``) naming what was
wrong, so a client gets one readable line and never a traceback."""

from __future__ import annotations


class ApiError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None,
                 type_: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param, self.type = status, message, code, param, type_

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
