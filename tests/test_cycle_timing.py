"""The job's own cycle times correct the calibrated cost of each depth."""

import math

import numpy as np
import pytest

from mtplx.autodepth.costs import CycleCosts
from mtplx.autodepth.timing import CycleTimes


def _play(timer, schedule, true_cost, slow=lambda i: 1.0, unclean=()):
    """Launch the (depth, cycles) runs of `schedule` one after another, each
    cycle taking true_cost[depth] x slow(cycle index) seconds."""
    t, i = 0.0, 0
    for depth, cycles in schedule:
        for _ in range(cycles):
            timer.launched(depth, t, clean=i not in unclean)
            t += true_cost[depth] * slow(i)
            i += 1
    return t


def test_measured_ratios_replace_calibrations_once_enough_pairs_are_in_and_slow_spells_cancel():
    calibrated = CycleCosts(4, {0: 10.0, 1: 15.0, 2: 18.0, 3: 21.0})  # depth 1 at 1.5 x plain
    true = {0: 12.0, 1: 15.0, 2: 18.0, 3: 21.0}  # really 1.25 x plain: calibration overpriced depth 1
    # The machine slows by half for cycles 100-199: both sides of a pair alike.
    spell = lambda i: 1.5 if 100 <= i < 200 else 1.0  # noqa: E731
    timer = CycleTimes(calibrated, min_pairs=4)
    # Four runs closed (a run closes when the depth changes): three pairs.
    _play(timer, [(1, 29), (0, 3)] * 2 + [(1, 5)], true, spell)
    assert timer.pair_count(0, 1) == 3
    assert timer.costs().seconds == calibrated.seconds  # too few pairs: as calibrated
    timer = CycleTimes(calibrated, min_pairs=4)
    _play(timer, [(1, 29), (0, 3)] * 8 + [(1, 5)], true, spell)  # through the spell and out
    assert timer.pair_count(0, 1) == 15  # 16 runs closed
    c = timer.costs().seconds
    assert c[1] / c[0] == pytest.approx(1.25)
    # Depths 2 and 3, never run, take depth 1's correction relative to plain.
    assert c[2] / c[0] == pytest.approx(18.0 / 12.0) and c[3] / c[1] == pytest.approx(21.0 / 15.0)


def test_only_clean_intervals_after_a_cycle_of_the_same_depth_are_samples():
    calibrated = CycleCosts(2, {0: 10.0, 1: 10.0})
    timer = CycleTimes(calibrated, pair_samples=1)  # one sample per side: any wrong one shows
    cost = {0: 10.0, 1: 20.0}
    depths = ([1] * 10 + [0] * 2) * 8
    t = 0.0
    for i, depth in enumerate(depths):
        timer.launched(depth, t, clean=i != 46)
        # As on a GPU, the host waits for the cycle before: the interval after
        # launch i is cycle i-1's, so the first cycle of a run is not its
        # depth's. Cycle 45 (depth 1, the last of its run) stalls 60 s, and
        # the launch that ends that interval says it was not clean.
        t += 60.0 if i == 45 else cost[depths[i - 1] if i else depth]
    assert len(timer.pairs[(0, 1)]) >= 8
    assert all(v == pytest.approx(math.log(2.0)) for v in timer.pairs[(0, 1)])


def test_a_pair_compares_the_samples_nearest_the_depth_change():
    calibrated = CycleCosts(1, {0: 1.0, 1: 1.0})
    timer = CycleTimes(calibrated, pair_samples=2)
    # Depth 1's run slows steadily; only its last two samples meet the burst.
    t = 0.0
    durations = [(1, 1.0), (1, 1.0), (1, 1.0), (1, 3.0), (1, 3.0), (0, 1.0), (0, 1.0), (0, 1.0), (1, 1.0)]
    for depth, seconds in durations:
        timer.launched(depth, t, clean=True)
        t += seconds
    (pair,) = timer.pairs[(0, 1)]
    assert pair == pytest.approx(math.log(3.0))  # depth 1 costs 3 x depth 0 next to it
    assert np.isfinite(pair)


def test_a_run_as_long_as_a_job_keeps_only_the_samples_a_pair_uses():
    timer = CycleTimes(CycleCosts(1, {0: 1.0, 1: 1.0}), pair_samples=3)
    t = 0.0
    for i in range(20000):  # a job that never changes depth: say, every row sampling
        timer.launched(1, t, clean=True)
        t += 1.0 if i < 19990 else 2.0  # its last ten cycles slow
    assert len(timer._run_first) == 3 and len(timer._run_last) == 3
    for _ in range(3):
        timer.launched(0, t, clean=True)
        t += 1.0
    timer.launched(1, t, clean=True)
    (pair,) = timer.pairs[(0, 1)]
    assert pair == pytest.approx(math.log(2.0))  # depth 1's last three samples against depth 0
