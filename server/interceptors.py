"""Server interceptors: bearer-token authentication, and INVALID_ARGUMENT (instead of
grpc's INTERNAL) for a request whose bytes do not parse."""

from __future__ import annotations

import hmac
import inspect
from collections.abc import Callable

import grpc

# Services a load balancer or a tool may call without the token, unless asked otherwise.
OPEN_SERVICES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


def _refusal(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, details: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that ends the call with `code` at once."""

    async def unary(request, context):
        await context.abort(code, details)

    async def streaming(request, context):
        await context.abort(code, details)
        yield  # (never reached: makes this an async generator)

    make = {
        (False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler,
    }[(handler.request_streaming, handler.response_streaming)]
    return make(streaming if handler.response_streaming else unary,
                request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)


class BearerTokenAuth(grpc.aio.ServerInterceptor):
    """Every call must carry the metadata `authorization: Bearer <token>`; a missing or
    wrong token gets UNAUTHENTICATED. `open_services` (method prefixes) need none."""

    def __init__(self, token: str, open_services: tuple[str, ...] = OPEN_SERVICES):
        self._expected = f"Bearer {token}".encode()
        self._open = open_services

    async def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or details.method.startswith(self._open):
            return handler
        given = next((value for key, value in details.invocation_metadata or () if key == "authorization"), None)
        if given is not None and hmac.compare_digest(given.encode() if isinstance(given, str) else given, self._expected):
            return handler
        problem = "carries no bearer token" if given is None else "carries a wrong bearer token"
        return _refusal(handler, grpc.StatusCode.UNAUTHENTICATED,
                        f"the call {problem}: send the metadata 'authorization: Bearer <token>' with the server's token")


class _Malformed:
    def __init__(self, error: Exception):
        self.error = error


class RejectMalformed(grpc.aio.ServerInterceptor):
    """grpc answers INTERNAL when a request does not deserialize; a client sent bad
    bytes, so answer INVALID_ARGUMENT instead, saying why."""

    async def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        parse = handler.request_deserializer

        def lenient(data: bytes):
            try:
                return parse(data)
            except Exception as e:  # protobuf's DecodeError, or anything a parser raises
                return _Malformed(e)

        async def check(request, context) -> None:
            if isinstance(request, _Malformed):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"the request is not a valid {details.method} message: {request.error}")

        if handler.response_streaming:
            behaviour = handler.unary_stream

            async def stream(request, context):
                await check(request, context)
                responses = behaviour(request, context)
                if inspect.isasyncgen(responses):
                    async for response in responses:
                        yield response
                else:  # a handler that writes with context.write (health's Watch)
                    await responses

            return grpc.unary_stream_rpc_method_handler(stream, lenient, handler.response_serializer)
        behaviour = handler.unary_unary

        async def unary(request, context):
            await check(request, context)
            return await behaviour(request, context)

        return grpc.unary_unary_rpc_method_handler(unary, lenient, handler.response_serializer)
