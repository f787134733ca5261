"""One narrow storage interface over fsspec URIs: ``file://`` (or a plain path), ``s3://``, ``memory://``.

Every artefact of raycheck (snapshot shards, manifests, the index, step log segments) goes through
``Storage``: whole-object ``put``/``get``, ``list``, ``delete``. Each operation runs with a timeout,
is retried with exponential backoff on transient errors, and after ``max_consecutive_failures``
operations that failed in a row the store refuses further work with ``StorageUnavailableError``
(a bound, not an endless retry loop).

Atomicity: ``put`` makes an object visible whole or not at all. Local files are written to a
temporary name, fsynced, renamed, and the folder is fsynced; on S3 a PUT (or a completed multipart
upload) is atomic by the protocol.

S3 settings: ``endpoint_url``, ``key``, ``secret`` as keyword options, else the standard
``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID`` and ``AWS_SECRET_ACCESS_KEY`` environment variables.
"""

from __future__ import annotations

import concurrent.futures
import fcntl
import hashlib
import logging
import os
import pathlib
import threading
import time
import uuid
from dataclasses import dataclass

import fsspec

log = logging.getLogger(__name__)


class StorageError(OSError):
    """A storage operation failed after its retries."""


class StorageTimeoutError(StorageError, TimeoutError):
    """A storage operation did not finish within its timeout."""


class StorageUnavailableError(StorageError):
    """Too many operations failed in a row: the store is treated as down."""


class PreconditionFailedError(FileExistsError):
    """A conditional put found other bytes than expected (someone else wrote the object first)."""


_MEMORY_LOCK = threading.Lock()  # memory:// objects live in this process: one lock makes compare-and-put atomic


NOT_RETRIED = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, FileExistsError, ValueError)
"""Errors that another attempt cannot fix (a missing object or bucket, a 403, a bad path)."""


@dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """Bounds on every storage operation.

    Attributes:
        attempts: tries per operation (>= 1).
        base_delay_s: first backoff delay; doubles per retry up to ``max_delay_s``.
        timeout_s: limit on one try, seconds.
        max_consecutive_failures: operations failing in a row before ``StorageUnavailableError``.
    """

    attempts: int = 4
    base_delay_s: float = 0.2
    max_delay_s: float = 5.0
    timeout_s: float = 120.0
    max_consecutive_failures: int = 3

    def __post_init__(self) -> None:
        for name in ("attempts", "max_consecutive_failures"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")


def _filesystem(protocol: str, options: dict, timeout_s: float):
    if protocol == "s3":
        opts = {
            "endpoint_url": options.get("endpoint_url") or os.environ.get("AWS_ENDPOINT_URL"),
            "key": options.get("key") or os.environ.get("AWS_ACCESS_KEY_ID"),
            "secret": options.get("secret") or os.environ.get("AWS_SECRET_ACCESS_KEY"),
            "config_kwargs": {"connect_timeout": min(timeout_s, 10), "read_timeout": timeout_s,
                              "retries": {"max_attempts": 1}},
            "use_listings_cache": False,
            "skip_instance_cache": True,
        }
        return fsspec.filesystem("s3", **{k: v for k, v in opts.items() if v is not None})
    return fsspec.filesystem(protocol, skip_instance_cache=protocol != "memory")


class Storage:
    """A folder of objects at ``uri``. Paths given to methods are relative, ``/``-separated.

    Args:
        uri: ``/abs/path``, ``file:///abs/path``, ``s3://bucket/prefix`` or ``memory://name``.
        retry: timeouts, retries and the consecutive-failure bound.
        create: create a missing local folder (False for read-only tools: it must exist).
        **options: backend options (S3: ``endpoint_url``, ``key``, ``secret``).

    Raises:
        ValueError: an unsupported URI scheme. FileNotFoundError: ``create`` is False and the local
            folder does not exist.
    """

    SCHEMES = ("file", "s3", "memory")

    def __init__(self, uri: str, *, retry: RetryPolicy = RetryPolicy(), create: bool = True, **options) -> None:
        protocol, _, rest = uri.partition("://") if "://" in uri else ("file", "", uri)
        if protocol not in self.SCHEMES:
            raise ValueError(f"{uri!r}: unsupported storage scheme {protocol!r}; use one of {', '.join(self.SCHEMES)}")
        self.uri, self.protocol, self.retry, self.options = uri, protocol, retry, options
        self.root = str(pathlib.Path(rest).resolve()) if protocol == "file" else rest.rstrip("/")
        self.fs = _filesystem(protocol, options, retry.timeout_s)
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="storage")
        self._lock = threading.Lock()
        self.consecutive_failures = 0
        if protocol == "file" and create:
            os.makedirs(self.root, exist_ok=True)
        elif protocol == "file" and not os.path.isdir(self.root):
            raise FileNotFoundError(f"{self.root}: no such folder")

    def __reduce__(self):  # rebuild in the receiving process (thread pools and clients do not pickle)
        return (_rebuild, (self.uri, self.retry, self.options))

    def __repr__(self) -> str:
        return f"Storage({self.uri!r})"

    def path(self, rel: str) -> str:
        """Backend path of ``rel``."""
        return f"{self.root}/{rel}" if rel else self.root

    def url(self, rel: str = "") -> str:
        """Full URI of ``rel``, for messages."""
        return self.path(rel) if self.protocol == "file" else f"{self.protocol}://{self.path(rel)}"

    # -- the bounded call ---------------------------------------------------------------------
    def _call(self, what: str, fn, *args):
        with self._lock:
            if self.consecutive_failures >= self.retry.max_consecutive_failures:
                raise StorageUnavailableError(
                    f"{self.url()}: {self.consecutive_failures} storage operations failed in a row; "
                    f"refusing {what} (check the endpoint, credentials and bucket, then restart)"
                )
        delay, last = self.retry.base_delay_s, None
        for attempt in range(1, self.retry.attempts + 1):
            future = self._pool.submit(fn, *args)
            try:
                result = future.result(timeout=self.retry.timeout_s)
            except concurrent.futures.TimeoutError:
                last = StorageTimeoutError(f"{what}: no answer within {self.retry.timeout_s:g} s")
            except NOT_RETRIED:
                with self._lock:
                    self.consecutive_failures = 0
                raise
            except Exception as exc:  # transient until proven otherwise: retried, then raised
                last = exc
            else:
                with self._lock:
                    self.consecutive_failures = 0
                return result
            log.warning("%s failed (try %d of %d): %s", what, attempt, self.retry.attempts, last)
            if attempt < self.retry.attempts:
                time.sleep(delay)
                delay = min(delay * 2, self.retry.max_delay_s)
        with self._lock:
            self.consecutive_failures += 1
        raise StorageError(f"{what} failed after {self.retry.attempts} tries: {type(last).__name__}: {last}") from last

    # -- operations ---------------------------------------------------------------------------
    def put(self, rel: str, data: bytes) -> None:
        """Write ``data`` as object ``rel``, atomically (see the module docstring)."""
        self._call(f"put {self.url(rel)}", self._put, rel, data)

    def _put(self, rel: str, data: bytes) -> None:
        target = self.path(rel)
        if self.protocol != "file":
            self.fs.pipe_file(target, data)
            return
        folder = os.path.dirname(target)
        os.makedirs(folder, exist_ok=True)
        tmp = f"{target}.tmp-{uuid.uuid4().hex[:8]}"
        try:
            with open(tmp, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def get(self, rel: str) -> bytes:
        """The bytes of object ``rel``. Raises ``FileNotFoundError`` when it does not exist."""
        return self._call(f"get {self.url(rel)}", self.fs.cat_file, self.path(rel))

    def exists(self, rel: str) -> bool:
        return self._call(f"exists {self.url(rel)}", self.fs.exists, self.path(rel))

    def list(self, prefix: str = "") -> list[str]:
        """Relative paths of every object under ``prefix`` (recursive), sorted; [] if none."""
        base = self.path(prefix).rstrip("/")

        def find() -> list[str]:
            try:
                found = self.fs.find(base)
            except FileNotFoundError:
                return []
            root = self.root.rstrip("/") + "/"
            return sorted(p.split(root, 1)[1] if root in p else p for p in found)

        return [p for p in self._call(f"list {self.url(prefix)}", find) if ".tmp-" not in p]

    def probe(self) -> None:
        """Check that the store is usable (write, read back, delete a small object).

        Raises:
            StorageError: unreachable or failing; FileNotFoundError: e.g. a missing bucket;
            PermissionError: e.g. a 403. Each message names the store.
        """
        name = f".raycheck-probe-{uuid.uuid4().hex[:8]}"
        try:
            self.put(name, b"ok")
            if self.get(name) != b"ok":
                raise StorageError(f"{self.url(name)}: read back other bytes than written")
            self.delete(name)
        except (FileNotFoundError, PermissionError) as exc:
            raise type(exc)(f"{self.url()} is not usable: {exc}") from exc

    def delete(self, rel: str) -> None:
        """Remove object ``rel`` (no error if it is already gone)."""

        def rm() -> None:
            try:
                self.fs.rm_file(self.path(rel))
            except FileNotFoundError:
                pass

        self._call(f"delete {self.url(rel)}", rm)


    # -- conditional writes ----------------------------------------------------------------------
    def put_if_match(self, rel: str, data: bytes, expected: bytes | None) -> None:
        """Write ``data`` as object ``rel`` only if the object still holds ``expected`` (None: only if
        it does not exist): a compare-and-swap, atomic against every other writer that uses it.

        How: S3, a conditional PUT (``If-Match`` with the MD5 ETag of ``expected``, which holds for
        single-part uploads without SSE-KMS; ``If-None-Match: *`` to create); local disk, compare and
        rename under an exclusive ``flock`` of the folder (writers on one host, or an NFS that honours
        flock); memory, a process-wide lock. A call that timed out here but completes later fails its
        comparison instead of overwriting a newer object.

        Raises:
            PreconditionFailedError: the object holds other bytes (not retried).
            StorageError: as ``put``.
        """
        self._call(f"conditional put {self.url(rel)}", self._put_if_match, rel, data, expected)

    def _put_if_match(self, rel: str, data: bytes, expected: bytes | None) -> None:
        if self.protocol == "s3":
            cond = {"IfNoneMatch": "*"} if expected is None else {"IfMatch": f'"{hashlib.md5(expected).hexdigest()}"'}
            try:
                self.fs.pipe_file(self.path(rel), data, **cond)
            except OSError as exc:
                cause = getattr(exc.__cause__, "response", None) or {}
                code = cause.get("Error", {}).get("Code")  # 409 ConditionalRequestConflict: a concurrent write; re-read
                if isinstance(exc, FileExistsError) or code in ("PreconditionFailed", "ConditionalRequestConflict"):
                    raise PreconditionFailedError(f"{self.url(rel)} changed since it was read") from exc
                raise
            return
        if self.protocol == "memory":
            with _MEMORY_LOCK:
                self._compare(rel, expected)
                self.fs.pipe_file(self.path(rel), data)
            return
        folder = os.path.dirname(self.path(rel))
        os.makedirs(folder, exist_ok=True)
        fd = os.open(folder, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            self._compare(rel, expected)
            self._put(rel, data)
        finally:
            os.close(fd)  # releases the lock

    def _compare(self, rel: str, expected: bytes | None) -> None:
        try:
            current = self.fs.cat_file(self.path(rel))
        except FileNotFoundError:
            current = None
        if current != expected:
            raise PreconditionFailedError(f"{self.url(rel)} changed since it was read")

    def remove_empty_folder(self, rel: str) -> None:
        """Remove the local folder ``rel`` if it is empty (object stores have no folders: no-op)."""
        if self.protocol != "file":
            return
        try:
            os.rmdir(self.path(rel))
        except OSError:  # not empty (e.g. another writer's new object), or already gone
            pass


def _rebuild(uri: str, retry: RetryPolicy, options: dict) -> Storage:
    return Storage(uri, retry=retry, **options)
