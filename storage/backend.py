"""One narrow storage interface over fsspec URIs: ``file://`` (or a plain path), ``s3://``, ``memory://``.

Every artefact of raycheck (snapshot shards, manifests, the index, step log segments) goes through
``Storage``: whole-object ``put``/``get`` (``put_stream``: an object written piece by piece, never
held whole in memory, hashed as it is written), ``list``, ``delete``. Each operation runs with a timeout
and is retried with exponential backoff on transient errors (a bound, not an endless retry loop).

Circuit breaker (``CircuitBreaker``): after ``max_consecutive_failures`` operations that failed in a
row the breaker opens and every call is refused at once with ``StorageUnavailableError`` (no waiting on
a dead endpoint). After a back-off (``breaker_backoff_s``, doubled after each failed probe, at most
``breaker_max_backoff_s``) it half-opens: the next call runs as the one probe (a single try); if
storage answers the breaker closes and work resumes, else it opens again. So a store that comes back
is used again within ``breaker_max_backoff_s`` of its return. ``Storage.breaker.state()`` reports it.

Atomicity: ``put`` makes an object visible whole or not at all. Local files are written to a
temporary name, fsynced, renamed, and the folder is fsynced; on S3 a PUT (or a completed multipart
upload) is atomic by the protocol (a streamed upload that fails is aborted). A local writer killed
mid-write leaves its temp file (``<name>.tmp-<8 hex>``): ``list`` never shows it, ``temp_files`` does,
and ``remove_stale_temp_files`` (run by snapshot retention and diff garbage collection) deletes those no
writer has touched for ``TEMP_MAX_AGE_S``.

Local writes and the step log's fsync: a local ``put`` writes its bytes ``write_chunk_bytes`` at a
time and ``os.fdatasync``-s each chunk, optionally paced to ``write_rate_bytes_per_s``, so that a big
object (a snapshot shard) never has more than one chunk per writing thread in flight. A step log
append on the same disk waits, in its fsync, for the writes in flight (the disk's queue and the cache
flush); measured with ``experiments.durability_bench --snapshot-load`` (docs/performance.md#snapshot-writes-and-the-logs-fsync). With
``write_direct`` a local put bypasses the page cache (``O_DIRECT``: ``storage.files.write_synced_pieces``),
so the writing thread itself, at its own CPU and I/O priority, moves the bytes to the disk.

S3 settings: ``endpoint_url``, ``key``, ``secret``, ``token`` as keyword options, else the standard
``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY`` and ``AWS_SESSION_TOKEN``
environment variables (``STORAGE_ENV``: what a run hands to every process it starts, on any node).

An endpoint that cannot be reached (nothing listens, unknown host) is named as such:
``StorageUnreachableError`` ("storage endpoint URL unreachable (connection refused)"), from an
operation that failed for that reason after its retries, and from ``check_reachable``, which
``probe``, ``check_bucket`` and the read-only tools run first, so that a server that is down is never
reported as a missing bucket or missing credentials. Missing S3 credentials are permanent: the
operation fails at once with ``StorageCredentialsError``, which says how to give them.
"""

from __future__ import annotations

import builtins
import concurrent.futures
import enum
import fcntl
import functools
import hashlib
import logging
import os
import pathlib
import socket
import threading
import time
import urllib.parse
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import fsspec

from raycheck.storage.files import DIRECT_ALIGN_BYTES, TEMP_MARK, atomic_write_pieces

log = logging.getLogger(__name__)
_T = TypeVar("_T")


class StorageError(OSError):
    """A storage operation failed after its retries."""


class StorageTimeoutError(StorageError, TimeoutError):
    """A storage operation did not finish within its timeout."""


class StorageUnreachableError(StorageError):
    """The storage endpoint cannot be reached (nothing listens, unknown host, no answer to a connection)."""


class StorageCredentialsError(StorageError, PermissionError):
    """No (or partial) S3 credentials were found: a configuration error, failed at once, never retried."""


CREDENTIALS_HELP = ("set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN for temporary credentials), "
                    "or AWS_PROFILE naming a profile of ~/.aws/credentials")
"""How to give S3 credentials, for ``StorageCredentialsError``'s message."""


class StorageUnavailableError(StorageError):
    """The circuit breaker is open (too many operations failed in a row): the call was refused untried."""


class StorageConsistencyError(StorageError):
    """The S3 server does not honour the conditional writes that fencing rests on (``Storage.check_conditional_writes``)."""


class PreconditionFailedError(FileExistsError):
    """A conditional put found other bytes than expected (someone else wrote the object first)."""


_MEMORY_LOCK = threading.Lock()  # memory:// objects live in this process: one lock makes compare-and-put atomic


NOT_RETRIED = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, FileExistsError, ValueError)
"""Errors that another attempt cannot fix (a missing object or bucket, a 403, a bad path)."""


def unreachable_reason(exc: BaseException) -> str | None:
    """Why ``exc``, or an exception in its ``__cause__``/``__context__`` chain, means that the endpoint
    was never reached: ``"connection refused"``, ``"host not found"``, ``"connect timed out"`` or
    ``"cannot connect"``; None when it was reached (or the chain says nothing about connecting)."""
    from botocore.exceptions import ConnectTimeoutError, EndpointConnectionError

    reason, seen = None, set()
    link: BaseException | None = exc
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        if isinstance(link, ConnectionRefusedError):
            return "connection refused"
        if isinstance(link, socket.gaierror):
            return "host not found"
        if isinstance(link, ConnectTimeoutError):
            reason = "connect timed out"
        elif isinstance(link, EndpointConnectionError):
            reason = reason or "cannot connect"
        link = link.__cause__ or link.__context__
    return reason


def _missing_credentials(exc: BaseException) -> bool:
    """Whether ``exc`` is botocore's "no credentials" or "partial credentials" error."""
    from botocore.exceptions import NoCredentialsError, PartialCredentialsError

    return isinstance(exc, (NoCredentialsError, PartialCredentialsError))


def split_uri(uri: str) -> tuple[str, str]:
    """``(scheme, rest)`` of a storage URI: ``s3://bucket/prefix`` -> ``("s3", "bucket/prefix")``; a
    plain path is ``file``: ``/a/b`` and ``file:///a/b`` -> ``("file", "/a/b")``. The one place a
    storage URI is taken apart (the scheme is not checked here: ``Storage`` refuses unsupported ones)."""
    scheme, sep, rest = uri.partition("://")
    return (scheme, rest) if sep else ("file", uri)


def local_path(uri: str) -> pathlib.Path | None:
    """The absolute local folder that a storage URI names (a path, or a ``file://`` URI); None for any
    other scheme (``s3://``, ``memory://``: storage that is not this machine's disk)."""
    scheme, rest = split_uri(uri)
    return pathlib.Path(rest).resolve() if scheme == "file" else None


def node_local(uri: str) -> bool:
    """Whether the storage at ``uri`` lives on one node only (a path, ``file://``, ``memory://``: lost
    with that node or process), unlike ``s3://``, which every node reaches."""
    return split_uri(uri)[0] in ("file", "memory")


CHECK_TIMEOUT_S = 10.0
"""The bound on one try of a start-up check (``Storage.check_reachable``, ``Storage.check_bucket``), seconds."""


@dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """Bounds on every storage operation.

    Attributes:
        attempts: tries per operation (>= 1).
        base_delay_s: first backoff delay; doubles per retry up to ``max_delay_s``.
        timeout_s: limit on one try, seconds.
        max_consecutive_failures: operations failing in a row before the breaker opens.
        breaker_backoff_s: seconds the breaker stays open before its first probe.
        breaker_max_backoff_s: bound on the open time, which doubles after each failed probe.
    """

    attempts: int = 4
    base_delay_s: float = 0.2
    max_delay_s: float = 5.0
    timeout_s: float = 120.0
    max_consecutive_failures: int = 3
    breaker_backoff_s: float = 1.0
    breaker_max_backoff_s: float = 10.0

    def __post_init__(self) -> None:
        for name in ("attempts", "max_consecutive_failures"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("timeout_s", "breaker_backoff_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.breaker_max_backoff_s < self.breaker_backoff_s:
            raise ValueError(f"breaker_max_backoff_s ({self.breaker_max_backoff_s}) must be >= breaker_backoff_s "
                             f"({self.breaker_backoff_s})")


class Admission(enum.Enum):
    """What the breaker lets a call do."""

    CALL = "call"  # closed: run with the retry policy
    PROBE = "probe"  # half-open: this call is the one probe (a single try)
    REFUSED = "refused"  # open, or another call is probing


class CircuitBreaker:
    """Closed -> open -> half-open -> closed, over whole operations (after their retries). Thread-safe.

    Closed: calls run; ``max_failures`` failed operations in a row open it. Open: calls are refused
    until ``backoff_s`` seconds (``clock`` time) have passed; then the next call is the probe and
    other calls are refused while it runs. A probe that succeeds closes the breaker and resets the
    back-off; one that fails opens it again for twice the back-off, at most ``max_backoff_s``.

    Args:
        max_failures: failed operations in a row that open the breaker (>= 1).
        backoff_s, max_backoff_s: the first and the largest open time, seconds.
        clock: monotonic seconds (injectable for tests).
    """

    def __init__(self, max_failures: int, backoff_s: float, max_backoff_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_failures, self.first_backoff_s, self.max_backoff_s = max_failures, backoff_s, max_backoff_s
        self.clock = clock
        self.consecutive_failures = 0
        self.backoff_s = backoff_s
        self.opened = 0
        """Times the breaker opened (from closed) in this process."""
        self.probes = 0
        self._open_until: float | None = None  # None: closed
        self._probing = False
        self._changed = threading.Condition()

    def _retry_in_s(self) -> float:
        return 0.0 if self._open_until is None else max(0.0, self._open_until - self.clock())

    def admit(self) -> Admission:
        """Whether a call may run now (a ``PROBE`` must be followed by ``record``)."""
        with self._changed:
            if self._open_until is None:
                return Admission.CALL
            if self._probing or self._retry_in_s() > 0:
                return Admission.REFUSED
            self._probing = True
            self.probes += 1
            return Admission.PROBE

    def record(self, ok: bool, probe: bool) -> None:
        """The outcome of an admitted call: ``ok`` when storage answered (even with e.g. a 404)."""
        with self._changed:
            if probe:
                self._probing = False
            if ok:
                if self._open_until is not None:
                    log.info("storage answers again (probe %d succeeded): breaker closed", self.probes)
                self.consecutive_failures, self.backoff_s, self._open_until = 0, self.first_backoff_s, None
            elif probe:
                self.backoff_s = min(self.backoff_s * 2, self.max_backoff_s)
                self._open_until = self.clock() + self.backoff_s
            else:
                self.consecutive_failures += 1
                if self._open_until is None and self.consecutive_failures >= self.max_failures:
                    self.opened += 1
                    self._open_until = self.clock() + self.backoff_s
                    log.warning("%d storage operations failed in a row: breaker open, next probe in %g s",
                                self.consecutive_failures, self.backoff_s)
            self._changed.notify_all()

    def wait_until_admitted(self, timeout_s: float) -> bool:
        """Block until a call would be admitted (closed, or a probe is due and none runs), at most
        ``timeout_s`` seconds (real time); returns whether it would be."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while self._open_until is not None and (self._probing or self._retry_in_s() > 0):
                left_s = deadline - time.monotonic()
                if left_s <= 0:
                    return False
                self._changed.wait(min(left_s, self._retry_in_s() or left_s))
            return True

    def state(self) -> dict[str, Any]:
        """``{"state": "closed" | "open" | "half_open", "consecutive_failures", "opened", "probes",
        "backoff_s", "retry_in_s"}`` (half-open: a probe is due or running)."""
        with self._changed:
            retry_in_s = self._retry_in_s()
            state = "closed" if self._open_until is None else "half_open" if self._probing or not retry_in_s else "open"
            return {"state": state, "consecutive_failures": self.consecutive_failures, "opened": self.opened,
                    "probes": self.probes, "backoff_s": self.backoff_s, "retry_in_s": retry_in_s}


LOCAL_WRITE_CHUNK_BYTES = 1 << 18
"""Bytes a local ``put`` writes between two ``os.fdatasync`` calls (256 KiB: chosen with
``experiments.durability_bench --snapshot-load``; docs/performance.md#snapshot-writes-and-the-logs-fsync)."""

TEMP_MAX_AGE_S = 6 * 3600.0
"""Seconds since its last modification after which a temp file of ``atomic_write`` counts as left by a
dead writer (``Storage.remove_stale_temp_files``): 6 hours. A live writer's temp file must never be
removed (its rename would then fail and the put with it), and a live writer modifies it at least once per
``LOCAL_WRITE_CHUNK_BYTES`` chunk: even paced at 1 KiB/s that is every 256 s, and an unchunked put writes
everything in one call; 6 hours is far beyond any write or storage stall, and on disk a temp file holds
at most one object."""


@dataclass(frozen=True)
class TempFile:
    """A temp file of ``atomic_write`` in a store: ``path`` (relative, ``/``-separated), ``bytes``, and
    ``age_s`` (seconds since its last modification, by this host's clock)."""

    path: str
    bytes: int
    age_s: float


class WritePacer:
    """Caps the rate at which the threads that share it write, in bytes per second: each ``wait(n)``
    reserves the next ``n / bytes_per_s`` seconds of the writing schedule and sleeps until its slot
    begins (no burst allowance). Thread-safe.

    Args:
        bytes_per_s: the cap (> 0).
        clock, sleep: monotonic seconds and a sleep in seconds (injectable for tests).

    Raises:
        ValueError: ``bytes_per_s`` is not > 0.
    """

    def __init__(self, bytes_per_s: float, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        if not bytes_per_s > 0:
            raise ValueError(f"write rate must be > 0 bytes per second, got {bytes_per_s}")
        self.bytes_per_s, self.clock, self.sleep = bytes_per_s, clock, sleep
        self._next_s: float | None = None
        self._lock = threading.Lock()

    def wait(self, nbytes: int) -> None:
        """Block until ``nbytes`` may be written."""
        with self._lock:
            now_s = self.clock()
            start_s = now_s if self._next_s is None else max(now_s, self._next_s)
            self._next_s = start_s + nbytes / self.bytes_per_s
        if start_s > now_s:
            self.sleep(start_s - now_s)


STORAGE_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_DEFAULT_REGION", "AWS_REGION",
               "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3")
"""The environment variables that S3 storage reads (here and in botocore): the credentials, the
region and the endpoint. Files that botocore may read instead (``~/.aws/credentials``,
``AWS_SHARED_CREDENTIALS_FILE``, ``AWS_PROFILE``) stay on the machine where they are."""


def storage_env() -> dict[str, str]:
    """The ``STORAGE_ENV`` variables set in this process, name -> value (secrets included: hand them
    only to Ray's runtime environment, never to a file or a log)."""
    return {k: os.environ[k] for k in STORAGE_ENV if k in os.environ}


class _Tally:
    """Bytes and sha256 of the pieces that pass through ``count``."""

    def __init__(self) -> None:
        self.bytes, self.sha256 = 0, hashlib.sha256()

    def count(self, pieces: Iterable[bytes | memoryview]) -> Iterator[bytes | memoryview]:
        for piece in pieces:
            self.sha256.update(piece)
            self.bytes += memoryview(piece).nbytes
            yield piece


def _upload(f: fsspec.spec.AbstractBufferedFile, pieces: Iterable[bytes | memoryview]) -> None:
    """Write ``pieces`` to the S3 file ``f`` (fsspec, opened ``"wb"``: it uploads a part each time its
    buffer reaches the block size) and close it, which completes the upload (a single PUT when it never
    reached one block). On any error the multipart upload is aborted and ``f`` is dropped unclosed, so
    that nothing becomes visible."""
    try:
        for piece in pieces:
            f.write(piece)
        f.close()
    except BaseException:
        try:
            f.discard()
        except Exception as exc:  # an unfinished multipart upload is never visible; S3 lifecycle rules expire it
            log.warning("could not abort the multipart upload of %s: %s", f.path, exc)
        f.closed = True  # close() would upload what the buffer holds
        raise


def _filesystem(protocol: str, options: dict[str, Any], timeout_s: float) -> fsspec.AbstractFileSystem:
    if protocol == "s3":
        opts = {
            "endpoint_url": options.get("endpoint_url") or os.environ.get("AWS_ENDPOINT_URL"),
            "key": options.get("key") or os.environ.get("AWS_ACCESS_KEY_ID"),
            "secret": options.get("secret") or os.environ.get("AWS_SECRET_ACCESS_KEY"),
            "token": options.get("token") or os.environ.get("AWS_SESSION_TOKEN"),  # temporary credentials: key, secret and token
            "config_kwargs": {"connect_timeout": min(timeout_s, 10), "read_timeout": timeout_s,
                              "retries": {"max_attempts": 1}},
            "use_listings_cache": False,
            "skip_instance_cache": True,
        }
        return fsspec.filesystem("s3", **{k: v for k, v in opts.items() if v is not None})
    return fsspec.filesystem(protocol, skip_instance_cache=protocol != "memory")



def pyarrow_filesystem(uri: str, options: Mapping[str, Any], timeout_s: float = 60.0) -> tuple[Any, str]:
    """``(pyarrow filesystem, path)`` of the remote ``uri`` for a library that takes pyarrow's (Ray Train's
    ``RunConfig(storage_path=path, storage_filesystem=fs)``): the fsspec filesystem ``Storage`` uses, with
    ``options`` and the environment's credentials, wrapped (``pyarrow.fs.FSSpecHandler``); reads and
    writes time out after ``timeout_s`` seconds."""
    import pyarrow.fs

    scheme, rest = split_uri(uri)
    return pyarrow.fs.PyFileSystem(pyarrow.fs.FSSpecHandler(_filesystem(scheme, dict(options), timeout_s))), rest

class Storage:
    """A folder of objects at ``uri``. Paths given to methods are relative, ``/``-separated.

    Args:
        uri: ``/abs/path``, ``file:///abs/path``, ``s3://bucket/prefix`` or ``memory://name``.
        retry: timeouts, retries and the consecutive-failure bound.
        create: create a missing local folder (False for read-only tools: it must exist).
        write_chunk_bytes: local puts ``os.fdatasync`` after every this many bytes (``write_synced``);
            None writes each object in one go and syncs it once.
        write_rate_bytes_per_s: caps the bytes per second of this store's local puts, all threads
            together (``WritePacer``); None: no cap.
        write_direct: local puts write with ``O_DIRECT`` (``storage.files.write_synced_pieces``; buffered
            where the file system refuses it), ``write_chunk_bytes`` at a time (None: no ``fdatasync``
            until the end); ignored by S3 and memory stores.
        **options: backend options (S3: ``endpoint_url``, ``key``, ``secret``, ``token``).

    Raises:
        ValueError: an unsupported URI scheme, a ``write_chunk_bytes`` or ``write_rate_bytes_per_s``
            that is not > 0, a ``write_direct`` ``write_chunk_bytes`` that is not a multiple of
            ``storage.files.DIRECT_ALIGN_BYTES`` (4096). FileNotFoundError: ``create`` is False and the local folder does not exist.
    """

    SCHEMES = ("file", "s3", "memory")

    def __init__(self, uri: str, *, retry: RetryPolicy = RetryPolicy(), create: bool = True,
                 write_chunk_bytes: int | None = LOCAL_WRITE_CHUNK_BYTES, write_rate_bytes_per_s: float | None = None,
                 write_direct: bool = False, **options: Any) -> None:
        protocol, rest = split_uri(uri)
        if protocol not in self.SCHEMES:
            raise ValueError(f"{uri!r}: unsupported storage scheme {protocol!r}; use one of {', '.join(self.SCHEMES)}")
        if write_chunk_bytes is not None and write_chunk_bytes < 1:
            raise ValueError(f"write_chunk_bytes must be >= 1 (or None: one write per object), got {write_chunk_bytes}")
        if write_direct and write_chunk_bytes is not None and write_chunk_bytes % DIRECT_ALIGN_BYTES:
            raise ValueError(f"write_chunk_bytes must be a multiple of {DIRECT_ALIGN_BYTES} for direct writes, got {write_chunk_bytes}")
        self.uri, self.protocol, self.retry, self.options = uri, protocol, retry, options
        self.write_chunk_bytes, self.write_rate_bytes_per_s = write_chunk_bytes, write_rate_bytes_per_s
        self.write_direct = write_direct
        self._pacer = WritePacer(write_rate_bytes_per_s) if write_rate_bytes_per_s is not None else None
        self.root = str(pathlib.Path(rest).resolve()) if protocol == "file" else rest.rstrip("/")
        self.fs = _filesystem(protocol, options, retry.timeout_s)
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="storage")
        self.breaker = CircuitBreaker(retry.max_consecutive_failures, retry.breaker_backoff_s, retry.breaker_max_backoff_s)
        self.last_failure: str | None = None
        """Why the last operation that failed after its retries failed (named in the breaker's refusals)."""
        if protocol == "file" and create:
            os.makedirs(self.root, exist_ok=True)
        elif protocol == "file" and not os.path.isdir(self.root):
            raise FileNotFoundError(f"{self.root}: no such folder")

    def __reduce__(self) -> tuple[Callable[..., Storage], tuple[Any, ...]]:  # rebuild in the receiving process (thread pools and clients do not pickle)
        return (_rebuild, (self.uri, self.retry, self.options, self.write_chunk_bytes, self.write_rate_bytes_per_s,
                           self.write_direct))

    def __repr__(self) -> str:
        return f"Storage({self.uri!r})"

    def path(self, rel: str) -> str:
        """Backend path of ``rel``."""
        return f"{self.root}/{rel}" if rel else self.root

    def url(self, rel: str = "") -> str:
        """Full URI of ``rel``, for messages."""
        return self.path(rel) if self.protocol == "file" else f"{self.protocol}://{self.path(rel)}"

    # -- the bounded call ---------------------------------------------------------------------
    def _call(self, what: str, fn: Callable[..., _T], *args: Any, timeout_s: float | None = None) -> _T:
        """``fn(*args)`` through the breaker, each try bounded by ``timeout_s`` (default the policy's), retried
        as the policy says; raises what ``_diagnosis`` names after the last try."""
        timeout_s = self.retry.timeout_s if timeout_s is None else timeout_s
        admission = self.breaker.admit()
        if admission is Admission.REFUSED:
            state = self.breaker.state()
            raise StorageUnavailableError(
                f"{self.url()}: {state['consecutive_failures']} storage operations failed in a row; refusing {what} "
                f"(circuit breaker {state['state']}, next probe in {state['retry_in_s']:.1f} s; last failure: "
                f"{self.last_failure}; check the endpoint, credentials and bucket)"
            )
        probe = admission is Admission.PROBE
        attempts = 1 if probe else self.retry.attempts
        delay = self.retry.base_delay_s
        last: Exception  # set by every try that does not return (attempts >= 1)
        for attempt in range(1, attempts + 1):
            future = self._pool.submit(fn, *args)
            try:
                result = future.result(timeout=timeout_s)
            except concurrent.futures.TimeoutError:
                last = StorageTimeoutError(f"{what}: no answer within {timeout_s:g} s")
            except NOT_RETRIED:
                self.breaker.record(ok=True, probe=probe)  # storage answered
                raise
            except Exception as exc:  # transient until proven otherwise: retried, then raised
                last = exc
                if _missing_credentials(exc):  # permanent: another try cannot find them
                    break
            else:
                self.breaker.record(ok=True, probe=probe)
                return result
            log.warning("%s failed (%s %d of %d): %s", what, "probe" if probe else "try", attempt, attempts, last)
            if attempt < attempts:
                time.sleep(delay)
                delay = min(delay * 2, self.retry.max_delay_s)
        error, self.last_failure = self._diagnosis(last)
        self.breaker.record(ok=error is StorageCredentialsError, probe=probe)  # missing credentials: not an outage
        raise error(f"{what} failed after {attempt} tr{'y' if attempt == 1 else 'ies'}: {self.last_failure}") from last

    def _diagnosis(self, last: BaseException) -> tuple[type[StorageError], str]:
        """The error class and reason for an operation that failed after its retries with ``last``.
        An S3 endpoint that cannot be reached is named as such, whatever botocore raised (it looks
        for credentials before it connects), so a failure not yet explained checks the endpoint; then
        missing credentials are named, with how to give them."""
        if self.protocol == "s3":
            reason = unreachable_reason(last)
            if reason is not None:
                return StorageUnreachableError, self._unreachable(reason)
            try:
                self.check_reachable()
            except StorageUnreachableError as exc:
                return StorageUnreachableError, str(exc)
        if _missing_credentials(last):
            return StorageCredentialsError, f"no S3 credentials ({last}): {CREDENTIALS_HELP}"
        return StorageError, f"{type(last).__name__}: {last}"

    @property
    def endpoint_url(self) -> str | None:
        """The S3 endpoint URL in use: the one given (``endpoint_url``, else ``$AWS_ENDPOINT_URL``), else
        the one botocore's client resolved (``$AWS_ENDPOINT_URL_S3``, else the region's AWS endpoint, e.g.
        ``https://s3.amazonaws.com``); None for local and memory storage."""
        if self.protocol != "s3":
            return None
        return self.options.get("endpoint_url") or os.environ.get("AWS_ENDPOINT_URL") or self.fs.s3.meta.endpoint_url

    def _unreachable(self, reason: str) -> str:
        return (f"storage endpoint {self.endpoint_url} unreachable ({reason}); check that the server runs and "
                "the endpoint URL (--s3-endpoint or $AWS_ENDPOINT_URL)")

    def check_reachable(self) -> None:
        """Check that the S3 endpoint (``endpoint_url``, AWS's own included) accepts a TCP connection
        (within ``min(timeout_s, 10)`` seconds); a no-op for local and memory storage. Run before anything
        whose failure an unreachable endpoint would disguise (a bucket check, missing credentials).

        Raises:
            StorageUnreachableError: "storage endpoint URL unreachable (REASON)", REASON e.g.
                ``connection refused``, ``host not found``, ``no answer within 10 s``.
        """
        if self.protocol != "s3":
            return
        url = self.endpoint_url
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise StorageUnreachableError(self._unreachable("not an http:// or https:// URL with a host"))
        timeout_s = min(self.retry.timeout_s, CHECK_TIMEOUT_S)
        try:
            port = parts.port or (443 if parts.scheme == "https" else 80)
            socket.create_connection((parts.hostname, port), timeout=timeout_s).close()
        except TimeoutError as exc:
            raise StorageUnreachableError(self._unreachable(f"no answer within {timeout_s:g} s")) from exc
        except (OSError, ValueError) as exc:  # ValueError: a port that is not a number
            raise StorageUnreachableError(self._unreachable(unreachable_reason(exc) or str(exc))) from exc

    def wait_until_usable(self, timeout_s: float | None = None) -> bool:
        """Block until the breaker would let a call through (at once when closed; while open, until
        its probe is due and no other probe runs). For background writers that would rather wait for
        the probe than have their write refused. ``timeout_s`` defaults to the longest that can take
        (``breaker_max_backoff_s`` + ``timeout_s`` of the policy). Returns whether a call would run."""
        if timeout_s is None:
            timeout_s = self.retry.breaker_max_backoff_s + self.retry.timeout_s
        return self.breaker.wait_until_admitted(timeout_s)

    # -- operations ---------------------------------------------------------------------------
    def put(self, rel: str, data: bytes) -> None:
        """Write ``data`` as object ``rel``, atomically (see the module docstring; ``put_stream`` of one piece).

        Raises:
            StorageError: as ``put_stream``.
        """
        self.put_stream(rel, lambda: (data,))

    def put_stream(self, rel: str, pieces: Callable[[], Iterable[bytes | memoryview]]) -> tuple[int, str]:
        """Write the concatenation of the byte strings (or contiguous buffers) that ``pieces()`` yields as
        object ``rel``, atomically, one piece at a time: the object is never held whole in memory (local:
        ``atomic_write_pieces``, chunked ``fdatasync``, pacing and direct I/O as ``put``; S3: an upload that buffers one
        part and completes, or is aborted, at the end; memory: joined, as memory objects are). Returns
        ``(bytes, sha256 hex)`` of what was written, hashed as it went.

        Every try calls ``pieces`` afresh (a retry restarts from the first byte), so ``pieces()`` must
        yield the same bytes each time: a callable, never a one-shot iterator.

        Raises:
            StorageError: writing failed after retries (nothing is visible under ``rel`` that was not
                there before); an exception of ``pieces`` is retried like a failed write.
        """
        return self._call(f"put {self.url(rel)}", self._put_stream, rel, pieces)

    def _put_stream(self, rel: str, pieces: Callable[[], Iterable[bytes | memoryview]]) -> tuple[int, str]:
        target, tally = self.path(rel), _Tally()
        stream = tally.count(pieces())
        if self.protocol == "file":
            os.makedirs(os.path.dirname(target), exist_ok=True)
            atomic_write_pieces(target, stream, self.write_chunk_bytes, self._pacer, self.write_direct)
        elif self.protocol == "memory":  # a memory object is its bytes, whole; published at once
            self.fs.pipe_file(target, b"".join(stream))
        else:
            _upload(self.fs.open(target, "wb"), stream)
        return tally.bytes, tally.sha256.hexdigest()

    def get(self, rel: str) -> bytes:
        """The bytes of object ``rel``. Raises ``FileNotFoundError`` when it does not exist."""
        return cast(bytes, self._call(f"get {self.url(rel)}", self.fs.cat_file, self.path(rel)))  # fsspec: untyped

    def exists(self, rel: str) -> bool:
        return cast(bool, self._call(f"exists {self.url(rel)}", self.fs.exists, self.path(rel)))  # fsspec: untyped

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

        return [p for p in self._call(f"list {self.url(prefix)}", find) if TEMP_MARK not in p]

    def temp_files(self, prefix: str = "") -> builtins.list[TempFile]:
        """The temp files of interrupted or ongoing local writes under ``prefix`` (recursive), sorted by
        path; [] for S3 and memory (their puts are atomic in the service and leave none).

        Raises:
            StorageError: listing failed after retries.
        """
        if self.protocol != "file":
            return []

        def walk() -> builtins.list[TempFile]:
            base, now, found = self.path(prefix).rstrip("/"), time.time(), []
            for folder, _, names in os.walk(base):
                for name in names:
                    if TEMP_MARK not in name:
                        continue
                    full = os.path.join(folder, name)
                    try:
                        st = os.stat(full)
                    except FileNotFoundError:  # renamed or removed meanwhile
                        continue
                    found.append(TempFile(os.path.relpath(full, self.root).replace(os.sep, "/"), st.st_size,
                                          max(now - st.st_mtime, 0.0)))
            return sorted(found, key=lambda t: t.path)

        return self._call(f"list temp files {self.url(prefix)}", walk)

    def remove_stale_temp_files(self, max_age_s: float = TEMP_MAX_AGE_S, prefix: str = "") -> builtins.list[TempFile]:
        """Delete the temp files under ``prefix`` (``temp_files``) unmodified for at least ``max_age_s``
        seconds (see ``TEMP_MAX_AGE_S`` for why a younger one is kept: its writer may be alive); returns
        those deleted. A failed delete is logged and left for the next call.

        Raises:
            ValueError: ``max_age_s`` < 0. StorageError: listing failed after retries.
        """
        if max_age_s < 0:
            raise ValueError(f"max_age_s must be >= 0, got {max_age_s}")
        removed = []
        for temp in self.temp_files(prefix):
            if temp.age_s < max_age_s:
                continue
            try:
                os.unlink(self.path(temp.path))
                removed.append(temp)
            except FileNotFoundError:
                pass
            except OSError as exc:
                log.warning("could not delete the stale temp file %s: %s", self.url(temp.path), exc)
        if removed:
            log.info("deleted %d stale temp file(s) of interrupted writes (%d bytes) in %s", len(removed),
                     sum(t.bytes for t in removed), self.url(prefix))
        return removed

    def probe(self) -> None:
        """Check that the store is usable (write, read back, delete a small object).

        Raises:
            StorageUnreachableError: the endpoint cannot be reached (``check_bucket`` checks it first).
            StorageError: failing; FileNotFoundError: e.g. a missing bucket;
            PermissionError: e.g. a 403. Each message names the store.
        """
        self.check_bucket()
        name = f".raycheck-probe-{uuid.uuid4().hex[:8]}"
        try:
            self.put(name, b"ok")
            if self.get(name) != b"ok":
                raise StorageError(f"{self.url(name)}: read back other bytes than written")
            self.delete(name)
        except (FileNotFoundError, PermissionError) as exc:
            raise type(exc)(f"{self.url()}: {exc}") from exc

    def conditional_write_faults(self) -> builtins.list[str]:
        """How the store fails the conditional writes fencing rests on, probed on a scratch object (deleted
        after): [] when it refuses both a PUT with ``If-None-Match: *`` over an existing key and a PUT with
        ``If-Match`` of a wrong ETag; else what it accepted. Local and memory stores compare under a lock
        here (``put_if_match``), so only S3 is probed; they give [].

        Raises:
            StorageError: the probe's writes failed (as ``put``).
        """
        if self.protocol != "s3":
            return []
        name = f".raycheck-probe-{uuid.uuid4().hex[:8]}"
        self.put(name, b"probe")
        faults = []
        try:
            for what, expected in (("a PUT with If-None-Match: * over an existing key", None),
                                   ("a PUT with If-Match of a wrong ETag", b"not the object held")):
                try:
                    self.put_if_match(name, b"overwritten", expected)
                    faults.append(f"accepted {what}")
                except PreconditionFailedError:
                    pass
        finally:
            self.delete(name)
        return faults

    def check_conditional_writes(self) -> None:
        """Refuse a store that does not honour conditional writes (``conditional_write_faults``).

        Raises:
            StorageConsistencyError: one line naming what the server accepted and the option that
                accepts the weaker guarantee (``--storage-consistency unfenced``).
            StorageError: the probe's writes failed.
        """
        if faults := self.conditional_write_faults():
            raise StorageConsistencyError(
                f"{self.url()}: the S3 server does not honour conditional writes (it {' and '.join(faults)}), so a stale "
                f"writer could overwrite a newer one's index unnoticed; use a server that honours them, or pass "
                f"--storage-consistency unfenced to accept that weaker guarantee")

    def check_bucket(self) -> None:
        """Check that an S3 store's bucket exists (a listing of a missing bucket would read as an empty
        store), the endpoint first (``check_reachable``); a no-op for local and memory storage. Each try
        waits at most ``CHECK_TIMEOUT_S`` seconds, and its request ends 2 s later (an endpoint that accepts
        connections and never answers fails the check in under a minute, not after the policy's tries of
        ``timeout_s``, and leaves no request behind that would hold up the process's exit).

        Raises:
            StorageUnreachableError: the endpoint cannot be reached.
            FileNotFoundError: "bucket 'NAME' does not exist; ...". PermissionError: e.g. a 403
                (``StorageCredentialsError``: no credentials). StorageError: other failures, after retries.
        """
        if self.protocol != "s3":
            return
        self.check_reachable()
        bucket = self.root.split("/", 1)[0]
        timeout_s = min(self.retry.timeout_s, CHECK_TIMEOUT_S)
        fs = _filesystem(self.protocol, self.options, timeout_s + 2)  # its call ends soon after the try gives up
        fs.retries = 1  # s3fs's own retries (5 by default) would keep that call going: the policy retries the check
        try:
            self._call(f"check bucket s3://{bucket}", functools.partial(fs.call_s3, "head_bucket", Bucket=bucket), timeout_s=timeout_s)
        except FileNotFoundError as exc:
            raise FileNotFoundError(f"bucket {bucket!r} does not exist; create it first, or check the bucket name "
                                    "and --s3-endpoint") from exc

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
            self._put_stream(rel, lambda: (data,))
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


def _rebuild(uri: str, retry: RetryPolicy, options: dict[str, Any], write_chunk_bytes: int | None = LOCAL_WRITE_CHUNK_BYTES,
             write_rate_bytes_per_s: float | None = None, write_direct: bool = False) -> Storage:
    return Storage(uri, retry=retry, write_chunk_bytes=write_chunk_bytes, write_rate_bytes_per_s=write_rate_bytes_per_s,
                   write_direct=write_direct, **options)
