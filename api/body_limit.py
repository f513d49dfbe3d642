"""Reject over-large request bodies before anything parses them (413 ``body_too_large``).

A pure ASGI middleware: it answers at once when ``Content-Length`` is above the limit and
otherwise counts the bytes as they stream in (chunked uploads have no length), so a client
can never make the API buffer more than ``max_body_bytes`` of one request.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from fastapi import HTTPException  # starlette's types ``detail`` as str; ours is the error dict
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.errors import openai_error_body, openai_style
from api.limit_messages import body_too_large


class BodyTooLarge(HTTPException):
    """Raised inside ``receive`` when a streamed body passes the limit.

    An ``HTTPException`` on purpose: FastAPI turns any other exception raised while reading a
    body into a generic 400, but re-raises HTTP exceptions, which our handler renders as 413.
    """

    def __init__(self, max_body_bytes: int, setting: str) -> None:
        super().__init__(413, detail=body_too_large(max_body_bytes, setting))


class BodyLimitMiddleware:
    """Enforce ``max_body_bytes`` on every HTTP request. The 413 names the setting of the limit
    it enforced: ``setting`` (a settings field's flat name), or ``path_setting`` on a path of
    ``path_limits``."""

    def __init__(
        self, app: ASGIApp, max_body_bytes: int, path_limits: Mapping[str, int] | None = None, *,
        setting: str = "max_body_bytes", path_setting: str = "batch_max_body_bytes",
    ) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        # Exact paths with their own (larger) limit, e.g. batch uploads on ``/v1/batches``.
        self.path_limits = dict(path_limits or {})
        self.setting, self.path_setting = setting, path_setting

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        limit = self.path_limits.get(path, self.max_body_bytes)
        setting = self.path_setting if path in self.path_limits else self.setting
        declared = _content_length(scope)
        if declared is not None and declared > limit:
            await self._reject(send, limit, setting, path)
            return

        received = 0
        response_started = False

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge(limit, setting)
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal response_started
            if message["type"] == "http.response.start":
                response_started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except BodyTooLarge:
            if not response_started:
                await self._reject(send, limit, setting, path)

    async def _reject(self, send: Send, limit: int, setting: str, path: str) -> None:
        shaped = body_too_large(limit, setting)
        if openai_style(path):  # the OpenAI-compatible routes answer in OpenAI's error shape
            error = shaped["error"]
            assert isinstance(error, dict)
            shaped = openai_error_body(413, error["code"], error["message"])
        body = json.dumps(shaped).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"connection", b"close"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None
