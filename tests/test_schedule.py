import numpy as np
import pytest

from raycheck.orchestrator.schedule import failure_schedule, parse_schedule


def test_schedules_are_seeded_and_reproducible():
    a = failure_schedule("poisson", 5, 100, seed=3)
    assert a == failure_schedule("poisson", 5, 100, seed=3) != failure_schedule("poisson", 5, 100, seed=4)
    steps = [f.step for f in a]
    assert steps == sorted(set(steps)) and all(0 <= s < 100 for s in steps)
    assert parse_schedule("weibull:6:0.7:both", 50, 1) == failure_schedule("weibull", 6, 50, 1, "both", shape=0.7)


@pytest.mark.parametrize("kind,shape", [("poisson", 1.0), ("weibull", 0.7), ("weibull", 2.0)])
def test_mean_inter_arrival_matches_the_mtbf(kind, shape):
    steps = [f.step for f in failure_schedule(kind, 5000.0, 200_000_000, seed=0, shape=shape)]
    gaps = np.diff(steps)  # ~40,000 arrivals: the standard error is under 1%; merging same-step arrivals is negligible
    assert abs(gaps.mean() / 5000.0 - 1) < 0.03


def test_bad_schedules_are_refused_clearly():
    with pytest.raises(ValueError, match="expected poisson:MTBF_STEPS"):
        parse_schedule("poisson", 10, 0)
    with pytest.raises(ValueError, match="choose one of poisson, weibull"):
        failure_schedule("gamma", 5, 10, 0)
    with pytest.raises(ValueError, match="mtbf_steps > 0"):
        parse_schedule("poisson:0", 10, 0)
    with pytest.raises(ValueError, match="target 'gpu'"):
        parse_schedule("poisson:3:gpu", 100, 0)
