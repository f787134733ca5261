"""LayerCheck's selection rule: forced units, staleness bound, threshold, byte budget, ties, validation."""

from __future__ import annotations

import math

import numpy as np
import pytest

from raycheck.policies.layerwise import LayerwiseConfig, Reason, UnitStatus, relative_change, select_units


def unit(name: str, change: float = 0.0, stale: int | None = 1, size: int = 100) -> UnitStatus:
    return UnitStatus(unit=name, relative_change=change, staleness_steps=stale, bytes=size)


def cfg(threshold: float = 0.01, bound: int = 10, budget: int = 0) -> LayerwiseConfig:
    return LayerwiseConfig(threshold=threshold, staleness_bound_steps=bound, max_bytes_per_check=budget)


def test_nothing_changed_nothing_written():
    d = select_units(cfg(), [unit("embed"), unit("layer.000", change=0.01), unit("norm", stale=9)])
    assert d.selected == () and d.deferred == () and d.bytes == 0


def test_threshold_is_strict_and_orders_by_decreasing_change():
    d = select_units(cfg(threshold=0.01), [
        unit("layer.000", change=0.01),  # at threshold: not over
        unit("layer.001", change=0.02),
        unit("layer.002", change=0.5),
        unit("norm", change=0.0),
    ])
    assert d.units == ("layer.002", "layer.001")
    assert set(d.reasons().values()) == {Reason.THRESHOLD}
    assert d.bytes == 200


def test_staleness_bound_is_inclusive_and_oldest_first_whatever_the_change():
    d = select_units(cfg(bound=10), [
        unit("layer.000", stale=9),
        unit("layer.001", stale=10),
        unit("layer.002", stale=30),
        unit("norm", change=0.9, stale=2),
    ])
    assert d.units == ("layer.002", "layer.001", "norm")
    assert d.reasons() == {"layer.002": Reason.STALENESS_BOUND, "layer.001": Reason.STALENESS_BOUND,
                           "norm": Reason.THRESHOLD}


def test_never_persisted_units_are_forced_first():
    d = select_units(cfg(budget=50), [unit("layer.000", change=0.9), unit("embed", stale=None, size=500),
                                      unit("layer.001", stale=99)])
    assert d.units == ("embed", "layer.001")
    assert d.reasons() == {"embed": Reason.FORCED_FIRST, "layer.001": Reason.STALENESS_BOUND}
    assert d.deferred == ("layer.000",) and d.bytes == 600


def test_budget_stops_at_the_first_unit_that_does_not_fit():
    units = [unit("layer.000", change=0.3, size=40), unit("layer.001", change=0.2, size=70),
             unit("layer.002", change=0.1, size=10)]
    d = select_units(cfg(budget=100), units)
    assert d.units == ("layer.000",) and d.deferred == ("layer.001", "layer.002") and d.bytes == 40
    assert select_units(cfg(budget=110), units).units == ("layer.000", "layer.001")  # exactly the budget fits
    assert select_units(cfg(budget=0), units).units == ("layer.000", "layer.001", "layer.002")  # 0: unlimited


def test_forced_units_spend_the_budget_and_are_taken_even_over_it():
    units = [unit("layer.000", change=0.3, size=40), unit("layer.001", stale=12, size=80)]
    d = select_units(cfg(budget=100), units)
    assert d.units == ("layer.001",) and d.deferred == ("layer.000",)
    d = select_units(cfg(budget=50), [unit("embed", stale=10, size=1000)])
    assert d.units == ("embed",) and d.bytes == 1000


def test_threshold_unit_larger_than_the_budget_waits_for_its_staleness_bound():
    big = [unit("embed", change=0.5, stale=3, size=1000)]
    assert select_units(cfg(budget=100, bound=4), big).deferred == ("embed",)
    big = [unit("embed", change=0.5, stale=4, size=1000)]
    assert select_units(cfg(budget=100, bound=4), big).reasons() == {"embed": Reason.STALENESS_BOUND}


def test_ties_are_broken_deterministically():
    d = select_units(cfg(), [unit("a", change=0.2, stale=1), unit("b", change=0.2, stale=5), unit("c", change=0.2, stale=1)])
    assert d.units == ("b", "a", "c")  # equal change: staler first, then input order
    d = select_units(cfg(bound=10), [unit("a", stale=12), unit("b", change=0.3, stale=12), unit("c", stale=12)])
    assert d.units == ("b", "a", "c")  # equal staleness: larger change first, then input order
    d = select_units(cfg(), [unit("x", stale=None), unit("y", stale=None)])
    assert d.units == ("x", "y")


def test_infinite_change_is_over_any_threshold():
    assert select_units(cfg(threshold=1e9), [unit("norm", change=math.inf)]).units == ("norm",)


@pytest.mark.parametrize("kwargs, field", [
    (dict(threshold=-0.1), "threshold"),
    (dict(threshold=math.nan), "threshold"),
    (dict(threshold=math.inf), "threshold"),
    (dict(threshold="0.1"), "threshold"),
    (dict(staleness_bound_steps=0), "staleness_bound_steps"),
    (dict(staleness_bound_steps=2.5), "staleness_bound_steps"),
    (dict(max_bytes_per_check=-1), "max_bytes_per_check"),
    (dict(max_bytes_per_check=True), "max_bytes_per_check"),
])
def test_config_validation_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        LayerwiseConfig(**{**dict(threshold=0.01, staleness_bound_steps=10), **kwargs})


def test_config_is_keyword_only_and_frozen():
    with pytest.raises(TypeError):
        LayerwiseConfig(0.01, 10)  # type: ignore[misc]
    with pytest.raises(AttributeError):
        cfg().threshold = 1.0  # type: ignore[misc]


@pytest.mark.parametrize("kwargs, field", [
    (dict(relative_change=-1.0), "relative_change"),
    (dict(relative_change=math.nan), "relative_change"),
    (dict(staleness_steps=-1), "staleness_steps"),
    (dict(bytes=-5), "bytes"),
    (dict(unit=""), "unit"),
])
def test_unit_status_validation(kwargs, field):
    with pytest.raises(ValueError, match=field):
        UnitStatus(**{**dict(unit="norm", relative_change=0.0, staleness_steps=1, bytes=1), **kwargs})


def test_duplicate_units_are_rejected():
    with pytest.raises(ValueError, match="layer.000"):
        select_units(cfg(), [unit("layer.000"), unit("layer.000")])


def test_relative_change_over_all_tensors_of_a_unit():
    then = {"a": np.array([3.0, 0.0], dtype=np.float32), "b": np.array([[4.0]], dtype=np.float32)}
    now = {"a": np.array([3.0, 1.0], dtype=np.float32), "b": np.array([[4.0]], dtype=np.float32)}
    assert relative_change(now, then) == pytest.approx(1 / 5)
    assert relative_change(then, then) == 0.0
    zero = {"a": np.zeros(3, np.float32)}
    assert relative_change(zero, zero) == 0.0
    assert relative_change({"a": np.ones(3, np.float32)}, zero) == math.inf


def test_relative_change_accumulates_in_float64():
    big = {"w": np.full(4, 3e38, dtype=np.float32)}  # squares overflow float32
    assert relative_change(big, big) == 0.0
    assert math.isfinite(relative_change({"w": np.full(4, 1.5e38, dtype=np.float32)}, big))


def test_relative_change_rejects_mismatched_tensors():
    with pytest.raises(ValueError, match="missing"):
        relative_change({"a": np.ones(2)}, {"a": np.ones(2), "b": np.ones(2)})
    with pytest.raises(ValueError, match="a: shape"):
        relative_change({"a": np.ones(2)}, {"a": np.ones(3)})
