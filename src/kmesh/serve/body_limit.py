"""A bound on request bodies for `kmesh serve` (`--max-body`): an ASGI middleware that answers
413, in OpenAI's error shape, to a body past the bound, before the app reads or parses it.

A body announced by Content-Length past the bound is refused without reading it; a chunked one
is refused as soon as the bytes received pass the bound (the app is then told the client left,
and what it sends is dropped), so a client can make the server hold at most the bound (plus one
chunk) per request. Everything but HTTP requests passes through. Wrap the whole app (outermost),
so that nothing inside answers first.
"""

import json
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from kmesh.serve.schema import error_body

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

access = logging.getLogger("kmesh.serve.access")
# A generous default: a 32,768-token chat is a few hundred KiB of JSON.
DEFAULT_MAX_BODY_BYTES = 16 << 20


class BodyLimit:
    def __init__(self, app: App, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers", ())).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await self._refuse(scope, send)
            return
        received = 0
        refused = False

        async def bounded_receive() -> Message:
            nonlocal received, refused
            if refused:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    refused = True
                    await self._refuse(scope, send)
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message: Message) -> None:
            if not refused:
                await send(message)

        try:
            await self.app(scope, bounded_receive, guarded_send)
        except Exception:
            if not refused:
                raise
            # The app failed reading the body it was cut off from: answered already.

    async def _refuse(self, scope: Scope, send: Send) -> None:
        access.info(
            "%s %s 413 body past --max-body (%d bytes)",
            scope["method"],
            scope["path"],
            self.max_bytes,
        )
        message = (
            f"the request body is larger than this server takes ({self.max_bytes} bytes): send "
            "a smaller one, or start kmesh serve with a larger --max-body"
        )
        body = json.dumps(error_body(message)).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": body})
