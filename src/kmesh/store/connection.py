"""One connection to a store's Unix socket, as StoreClient (client.py) uses it: a request goes
out as one frame and its answer comes back as one (protocol.py), within the timeout plus the
request's own wait.

Every failure ends the connection: an unreachable socket, a lost or late answer, a frame that
does not decode, an `Error` answer, or an answer the caller did not expect (`unexpected`) close it
and are raised as StoreUnavailable; a closed connection raises it on every later call, so the
caller's fallback ("compute it here") never depends on a half-read stream.
"""

import socket

from kmesh.store.errors import StoreUnavailable
from kmesh.store.framing import encode_frame, read_frame
from kmesh.store.protocol import (
    AnyAnswer,
    AnyRequest,
    Error,
    ProtocolError,
    decode_answer,
)


class Connection:
    """A connected socket to the store at `socket_path` (StoreUnavailable if it cannot be
    reached), answering in `timeout` seconds."""

    def __init__(self, socket_path: str, timeout: float) -> None:
        self.socket_path = socket_path
        self.timeout = timeout
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            sock.connect(socket_path)
        except OSError as error:
            sock.close()
            raise StoreUnavailable(f"cannot reach the store at {socket_path}: {error}") from None
        self._sock: socket.socket | None = sock

    def call(self, request: AnyRequest, wait: float = 0.0) -> AnyAnswer:
        """The store's answer to `request`; `wait`: seconds the store may hold it back (a
        waiting acquire), on top of the timeout."""
        sock = self._sock
        if sock is None:
            raise StoreUnavailable(
                f"this client's connection to the store at {self.socket_path} is closed; open a "
                "new StoreClient"
            )
        try:
            sock.settimeout(self.timeout + wait)
            sock.sendall(encode_frame(request))
            answer = decode_answer(read_frame(sock))
        except (OSError, ProtocolError) as error:
            self.close()
            reason = "no answer in time" if isinstance(error, TimeoutError) else error
            raise StoreUnavailable(f"lost the store at {self.socket_path}: {reason}") from None
        if isinstance(answer, Error):
            self.close()
            raise StoreUnavailable(
                f"the store rejected a request ({answer.code}): {answer.message}"
            )
        return answer

    def unexpected(self, answer: AnyAnswer) -> StoreUnavailable:
        """Close the connection over an answer that does not fit its request; the error to
        raise."""
        self.close()
        return StoreUnavailable(f"unexpected answer from the store: {answer!r:.200}")

    @property
    def closed(self) -> bool:
        return self._sock is None

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
