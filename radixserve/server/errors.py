"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}`` with a 4xx/5xx status."""

from __future__ import annotations

from typing import Any

from radixserve.core import GenerateResult

TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    500: "internal_error",
    503: "service_unavailable",
}


RETRY_AFTER_SECONDS = 1  # what a 503 for lack of capacity tells the client to wait


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.headers = headers

    @classmethod
    def overloaded(cls, message: str, code: str = "overloaded") -> APIError:
        """503 with Retry-After: the server lacks capacity now; the same request may succeed soon."""
        return cls(503, message, code, headers={"Retry-After": str(RETRY_AFTER_SECONDS)})

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.code, self.param)


def error_body(status: int, message: str, code: str | None = None, param: str | None = None) -> dict[str, Any]:
    kind = TYPES.get(status, "invalid_request_error" if status < 500 else "internal_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code or status}}


def result_error(result: GenerateResult) -> APIError | None:
    """The HTTP error for a request the engine failed: 503 (+ Retry-After) for capacity, else 500."""
    if result.error is None:
        return None
    if result.error_kind == "shutdown":
        return APIError.overloaded(result.error, "shutting_down")
    if result.error_kind == "capacity":
        return APIError.overloaded(result.error, "overloaded")
    return APIError(500, result.error, "engine_error")


def raise_first_error(results: list[GenerateResult]) -> None:
    for result in results:
        error = result_error(result)
        if error is not None:
            raise error


def error_event(result: GenerateResult) -> dict[str, Any]:
    """The SSE payload for a request that failed mid-stream."""
    error = result_error(result)
    assert error is not None
    return error.body()
