"""The warm standby policy (``policies.standby``): pure, each figure's effect on the decision."""

from __future__ import annotations

import dataclasses

import pytest

from raycheck.policies.standby import GIB, StandbyCosts, standby_decision

TINY = StandbyCosts(load_s=6.0, load_cpu_s=5.0, standby_bytes=int(0.6 * GIB), available_bytes=16 * GIB, restart_s=4.0,
                    idle_cpu_share=0.002, mtbf_s=3600.0, cores=2.0)
"""A tiny-model executor on a 2-core machine: a 6 s cold start, 5 CPU-s, 0.6 GiB resident, Ray Train's start 4 s."""


def test_a_cheap_standby_pays_and_says_what_it_compared():
    d = standby_decision(TINY)
    assert d.keep and d.saved_s == 10.0 and d.cost_s == pytest.approx((5.0 + 0.002 * 3600) / 2)
    assert d.reason == ("warm standby on: per failure (one per MTBF 3600 s) it saves 10.0 s of cold start and costs 6.10 s of "
                        "the node's 2 cores (load 5.0 CPU-s, waiting 0.002 CPU/s), and holds 0.60 GiB")


def test_waiting_that_costs_more_cpu_than_a_cold_start_saves_turns_it_off():
    d = standby_decision(dataclasses.replace(TINY, idle_cpu_share=0.01))  # (36 CPU-s per MTBF hour + 5) / 2 > 10 s saved
    assert not d.keep and d.reason.startswith("warm standby off: per failure") and d.cost_s == pytest.approx(20.5)
    assert standby_decision(dataclasses.replace(TINY, idle_cpu_share=0.01, cores=8.0)).keep  # 41 / 8 < 10


def test_a_standby_that_would_crowd_the_node_is_off_whatever_it_saves():
    d = standby_decision(dataclasses.replace(TINY, available_bytes=int(1.1 * GIB), load_s=600.0))
    assert not d.keep and d.reason == "warm standby off: it would hold 0.60 GiB and the node has 1.10 GiB available (needs 2x)"
    assert standby_decision(dataclasses.replace(TINY, available_bytes=int(1.2 * GIB) + 1)).keep  # exactly twice: kept


@pytest.mark.parametrize("field, value", [("mtbf_s", 0.0), ("cores", 0.0), ("load_s", -1.0), ("idle_cpu_share", float("nan"))])
def test_bad_figures_are_refused_by_name(field, value):
    with pytest.raises(ValueError, match=rf"^StandbyCosts\.{field} must be"):
        dataclasses.replace(TINY, **{field: value})
