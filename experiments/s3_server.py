"""A real S3-compatible server on 127.0.0.1 that experiments and tests own, so they can take it down.

``LocalS3Server`` runs moto's S3 server (the ``test`` extra: ``moto[server]``) on a fixed port;
``outage(seconds)`` stops it at once and starts it again on the same port after ``seconds`` on a
timer thread. Buckets and objects survive an outage (moto keeps them in this process), as they
would on a real object store whose endpoint goes away and comes back.
"""

from __future__ import annotations

import socket
import threading
import time
import uuid


_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now and that this process has not handed out before: two
    calls in a row may otherwise get the same port while the first is not bound yet (a ``ray start``
    given one port for two of its servers then fails)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


class LocalS3Server:
    """An S3 server on ``127.0.0.1:port`` with one bucket (``bucket``). Use as a context manager.

    Raises:
        RuntimeError: moto is not installed (``pip install -e '.[test]'``).
    """

    def __init__(self, port: int | None = None, bucket: str | None = None) -> None:
        try:
            from moto.server import ThreadedMotoServer
        except ImportError as exc:
            raise RuntimeError("the local S3 server needs moto: pip install -e '.[test]'") from exc
        self._factory = ThreadedMotoServer
        self.port = port or free_port()
        self.bucket = bucket or f"raycheck-{uuid.uuid4().hex[:10]}"
        self._server: ThreadedMotoServer | None = None
        self._lock = threading.Lock()
        self.outages: list[tuple[float, float]] = []
        """(start unix time, seconds) of each outage."""

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def uri(self, prefix: str) -> str:
        """``s3://<bucket>/<prefix>``."""
        return f"s3://{self.bucket}/{prefix}"

    def start(self) -> "LocalS3Server":
        with self._lock:
            if self._server is None:
                self._server = self._factory(ip_address="127.0.0.1", port=self.port, verbose=False)
                self._server.start()
        return self

    def stop(self) -> None:
        with self._lock:
            if self._server is not None:
                self._server.stop()
                self._server = None

    def create_bucket(self) -> None:
        import s3fs

        s3fs.S3FileSystem(endpoint_url=self.endpoint, skip_instance_cache=True).mkdir(self.bucket)

    def outage(self, seconds: float) -> None:
        """Stop the server now and start it again after ``seconds``; returns at once."""
        self.outages.append((time.time(), seconds))
        self.stop()
        timer = threading.Timer(seconds, self.start)
        timer.daemon = True
        timer.start()

    def __enter__(self) -> "LocalS3Server":
        self.start()
        self.create_bucket()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
