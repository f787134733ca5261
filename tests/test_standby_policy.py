"""The warm standby policy (``policies.standby``): pure, each figure's effect on the decision."""

from __future__ import annotations

import dataclasses

import pytest

from raycheck.policies.standby import GIB, StandbyCosts, failure_interval, standby_decision

TINY = StandbyCosts(load_s=6.0, load_cpu_s=5.0, restart_s=4.0, standby_bytes=int(0.6 * GIB), available_bytes=16 * GIB,
                    idle_cpu_share=0.01, failure_interval_s=600.0, training_cores=2.0)
"""A tiny-model executor as measured on a 2-core machine: a 6 s cold start of 5 CPU-s, 0.6 GiB resident, Ray
Train's start 4 s, 1 % of a core while waiting; two one-thread workers, a failure every 10 minutes."""


def test_a_standby_pays_when_the_cores_a_cold_start_idles_outweigh_its_load_and_wait():
    d = standby_decision(TINY)  # saved (6 + 4) s x 2 cores = 20 core-s; cost 5 + 0.01 x 600 = 11 core-s
    assert d.keep and (d.saved_core_s, d.cost_core_s) == (20.0, pytest.approx(11.0))
    assert d.reason == ("warm standby on: a failure every 600 s would idle 2 training cores for a 10.0 s cold start "
                        "(20.0 core-s); a standby costs 11.0 core-s (load 5.0, waiting 0.010 CPU/s) and holds 0.60 GiB")


def test_rare_failures_leave_a_waiting_standby_more_costly_than_the_restarts_it_saves():
    d = standby_decision(dataclasses.replace(TINY, failure_interval_s=3600.0))  # 5 + 36 = 41 > 20
    assert not d.keep and d.reason.startswith("warm standby off: a failure every 3600 s") and d.cost_core_s == pytest.approx(41.0)
    assert standby_decision(dataclasses.replace(TINY, failure_interval_s=3600.0, training_cores=8.0)).keep  # 80 > 41


def test_a_standby_that_would_crowd_the_node_is_off_whatever_it_saves():
    d = standby_decision(dataclasses.replace(TINY, available_bytes=int(1.1 * GIB), load_s=600.0))
    assert not d.keep and d.reason == "warm standby off: it would hold 0.60 GiB and the node has 1.10 GiB available (needs 2x)"
    assert standby_decision(dataclasses.replace(TINY, available_bytes=int(1.2 * GIB) + 1)).keep  # twice what it holds: kept


def test_injected_failures_shorten_the_interval_to_the_runs_length_over_their_count():
    assert failure_interval(3600.0, 16, 0, 0.1) == 3600.0  # none injected: the configured MTBF
    assert failure_interval(3600.0, 16, 2, 0.1) == pytest.approx(0.8)  # 16 steps x 0.1 s / 2
    assert failure_interval(60.0, 10_000, 1, 1.0) == 60.0  # the configured MTBF when it is shorter


@pytest.mark.parametrize("field, value", [("failure_interval_s", 0.0), ("training_cores", 0.0), ("load_s", -1.0),
                                          ("idle_cpu_share", float("nan"))])
def test_bad_figures_are_refused_by_name(field, value):
    with pytest.raises(ValueError, match=rf"^StandbyCosts\.{field} must be"):
        dataclasses.replace(TINY, **{field: value})
