"""The storage circuit breaker: opens after failures in a row, half-opens after a bounded back-off,
closes when a probe succeeds (issue 14 item 6). Time is an injected clock: no sleeps."""

from __future__ import annotations

import uuid

import pytest
from moto.server import ThreadedMotoServer

from conftest import free_port, make_bucket
from raycheck.storage.backend import Admission, CircuitBreaker, RetryPolicy, Storage, StorageError, StorageUnavailableError


class Clock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def opened_breaker(max_failures: int = 1, max_backoff_s: float = 8.0) -> tuple[CircuitBreaker, Clock]:
    """A breaker (first back-off 1 s) on a fake clock, after ``max_failures`` failed calls: open."""
    clock = Clock()
    breaker = CircuitBreaker(max_failures, backoff_s=1.0, max_backoff_s=max_backoff_s, clock=clock)
    fail(breaker, max_failures)
    return breaker, clock


def fail(breaker: CircuitBreaker, times: int) -> None:
    for _ in range(times):
        assert breaker.admit() is Admission.CALL
        breaker.record(ok=False, probe=False)


def test_opens_after_failures_in_a_row_and_a_success_resets_the_count():
    breaker = CircuitBreaker(3, backoff_s=1.0, max_backoff_s=8.0, clock=Clock())
    fail(breaker, 2)
    breaker.record(ok=True, probe=False)
    fail(breaker, 2)
    assert breaker.state()["state"] == "closed" and breaker.state()["consecutive_failures"] == 2
    fail(breaker, 1)
    assert breaker.state() == {"state": "open", "consecutive_failures": 3, "opened": 1, "probes": 0,
                               "backoff_s": 1.0, "retry_in_s": 1.0}
    assert breaker.admit() is Admission.REFUSED


def test_half_opens_after_the_back_off_with_one_probe_and_closes_when_it_succeeds():
    breaker, clock = opened_breaker()
    clock.now_s += 0.999
    assert breaker.admit() is Admission.REFUSED
    clock.now_s += 0.001
    assert breaker.state()["state"] == "half_open"
    assert breaker.admit() is Admission.PROBE
    assert breaker.admit() is Admission.REFUSED  # one probe at a time
    breaker.record(ok=True, probe=True)
    assert breaker.state() == {"state": "closed", "consecutive_failures": 0, "opened": 1, "probes": 1,
                               "backoff_s": 1.0, "retry_in_s": 0.0}
    assert breaker.admit() is Admission.CALL


def test_failed_probes_double_the_back_off_up_to_its_bound():
    breaker, clock = opened_breaker(max_backoff_s=5.0)
    waits_s = []
    for _ in range(5):
        waits_s.append(breaker.state()["retry_in_s"])
        clock.now_s += waits_s[-1]
        assert breaker.admit() is Admission.PROBE
        breaker.record(ok=False, probe=True)
        assert breaker.state()["state"] == "open"
    assert waits_s == [1.0, 2.0, 4.0, 5.0, 5.0]
    clock.now_s += 5.0
    assert breaker.admit() is Admission.PROBE
    breaker.record(ok=True, probe=True)
    fail(breaker, 1)  # a new outage starts from the first back-off again
    assert breaker.state()["retry_in_s"] == 1.0 and breaker.state()["opened"] == 2


def test_waiting_for_admission_returns_at_once_when_closed_or_due_and_times_out_while_open():
    assert CircuitBreaker(1, backoff_s=1.0, max_backoff_s=1.0, clock=Clock()).wait_until_admitted(0) is True
    breaker, clock = opened_breaker()
    assert breaker.wait_until_admitted(0.01) is False
    clock.now_s += 1.0
    assert breaker.wait_until_admitted(0) is True


def test_policy_refuses_a_bound_below_the_first_back_off():
    with pytest.raises(ValueError, match="breaker_max_backoff_s"):
        RetryPolicy(breaker_backoff_s=5.0, breaker_max_backoff_s=1.0)
    with pytest.raises(ValueError, match="breaker_backoff_s must be > 0"):
        RetryPolicy(breaker_backoff_s=0)


def test_a_store_that_comes_back_is_used_again():
    """Real S3 calls: an endpoint where nothing listens opens the breaker; a moto server started on
    that port answers the probe after the back-off, and the store works again."""
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    policy = RetryPolicy(attempts=1, timeout_s=5.0, max_consecutive_failures=2, breaker_backoff_s=3.0)
    bucket = f"back-{uuid.uuid4().hex[:8]}"
    storage = Storage(f"s3://{bucket}/run", retry=policy, endpoint_url=endpoint)
    clock = Clock()
    storage.breaker.clock = clock
    for _ in range(2):
        with pytest.raises(StorageError, match="failed after 1 try"):
            storage.put("x", b"1")
    with pytest.raises(StorageUnavailableError, match=r"refusing put .*breaker open, next probe in 3.0 s"):
        storage.put("x", b"1")
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        make_bucket(endpoint, bucket)
        with pytest.raises(StorageUnavailableError):  # storage is back, but the back-off has not passed
            storage.get("x")
        clock.now_s += 3.0
        with pytest.raises(FileNotFoundError):  # the probe: storage answers (the object is missing)
            storage.get("x")
        assert storage.breaker.state()["state"] == "closed"
        storage.put("x", b"2")
        assert storage.get("x") == b"2"
        assert (storage.breaker.opened, storage.breaker.probes) == (1, 1)
    finally:
        server.stop()
