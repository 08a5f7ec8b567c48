"""Domain errors and the one place they become gRPC status codes.

Engines raise these; thin servicers let `grpc_errors` translate them, so every error a client sees
carries the right code and a message that says what to fix.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable

import grpc

log = logging.getLogger(__name__)


class SpecdError(Exception):
    """Base class: a failure with a gRPC status code and a message meant for the caller."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL
    trailing_metadata: tuple = ()  # extra facts for the client, e.g. what was generated before a failure


class InvalidArgument(SpecdError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(SpecdError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(SpecdError):
    code = grpc.StatusCode.ALREADY_EXISTS


class ResourceExhausted(SpecdError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class FailedPrecondition(SpecdError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class Cancelled(SpecdError):
    code = grpc.StatusCode.CANCELLED


class Unavailable(SpecdError):
    code = grpc.StatusCode.UNAVAILABLE


def require(condition: bool, message: str) -> None:
    """Raise InvalidArgument with `message` unless `condition` holds."""
    if not condition:
        raise InvalidArgument(message)


def grpc_errors(method: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate a unary servicer method: SpecdError → its status code; anything else → INTERNAL, logged."""

    @functools.wraps(method)
    def wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return method(self, request, context)
        except SpecdError as error:
            _abort(context, error)
        except grpc.RpcError as error:  # an upstream service failed: pass its status on
            context.abort(_upstream_code(error), f"upstream: {_upstream_details(error)}")
        except Exception:
            context.abort(*unexpected(method.__name__))

    return wrapper


def unexpected(where: str) -> tuple[grpc.StatusCode, str]:
    """The status an error that is no SpecdError gets (INTERNAL), logged with its traceback; call it
    from an `except` block."""
    log.exception("unexpected error in %s", where)
    return grpc.StatusCode.INTERNAL, f"internal error in {where}; see server log"


def grpc_stream_errors(method: Callable[..., Any]) -> Callable[..., Any]:
    """Like `grpc_errors`, for server-streaming methods (generators)."""

    @functools.wraps(method)
    def wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            yield from method(self, request, context)
        except SpecdError as error:
            _abort(context, error)
        except grpc.RpcError as error:
            context.abort(_upstream_code(error), f"upstream: {_upstream_details(error)}")
        except Exception:
            context.abort(*unexpected(method.__name__))

    return wrapper


def _abort(context: grpc.ServicerContext, error: SpecdError) -> None:
    if error.trailing_metadata:
        context.set_trailing_metadata(error.trailing_metadata)
    context.abort(error.code, str(error))


def _upstream_code(error: grpc.RpcError) -> grpc.StatusCode:
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNAVAILABLE
    return code if isinstance(code, grpc.StatusCode) else grpc.StatusCode.UNAVAILABLE


def _upstream_details(error: grpc.RpcError) -> str:
    return error.details() if hasattr(error, "details") else str(error)
