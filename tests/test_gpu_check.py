"""`make gpu-check` (scripts/gpu_check.py): what it measures on the GPU machine, and how it keeps to its time.
The whole script runs here as `make gpu-check-dry` (minutes: not part of the suite)."""

import importlib.util
import sys

import pytest
from conftest import REPO

from mtplx.testing import SHAPES


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_the_check_benches_both_real_shapes_at_the_issues_batch_sizes_depths_and_temperatures(gpu_check):
    plan = gpu_check.real_plan()
    assert plan.shapes == {"qwen3.5-0.8b": SHAPES["qwen3.5-0.8b"], "qwen3.5-4b": SHAPES["qwen3.5-4b"]}
    for name in plan.shapes:
        assert sorted(B for n, B in plan.bench_order if n == name) == [1, 8, 32, 64]
    assert plan.bench_order[:2] == [("qwen3.5-4b", 1), ("qwen3.5-4b", 32)]  # the targets' cells first
    assert plan.depths == "0,1,2,3,auto" and plan.temperatures == "0,1"
    assert plan.greedy_shape in plan.shapes and set(plan.greedy_depths) == {0, 1, 2, 3}


def test_the_gpu_tests_it_runs_are_the_files_with_gpu_marked_tests(gpu_check):
    files = gpu_check.gpu_test_files()
    for name in ("test_runtime.py", "test_half_precision.py", "test_runtime_sampling.py", "test_sampling.py"):
        assert f"tests/{name}" in files
    assert "tests/test_gpu_check.py" not in files


def test_a_step_with_no_time_left_is_skipped_and_one_past_its_limit_is_stopped(gpu_check):
    skipped = gpu_check.run_step(gpu_check.Step("late"), [sys.executable, "-c", "pass"], limit=0.5)
    assert skipped.status == "skipped" and skipped.detail["why"] == "no time left"
    slow = gpu_check.run_step(gpu_check.Step("slow"), [sys.executable, "-c", "import time; time.sleep(30)"], limit=2)
    assert slow.status == "timed out" and slow.seconds < 10
    ok = gpu_check.run_step(gpu_check.Step("quick"), [sys.executable, "-c", "print('hi')"], limit=30)
    assert ok.status == "ok"


def test_the_summary_names_steps_that_did_not_run_and_tolerates_missing_cells(gpu_check, tmp_path):
    steps = [gpu_check.Step("bench qwen3.5-4b B=64", detail={"why": "under 20 s left"})]
    lines = gpu_check.summary_lines(steps, [], tmp_path / "no-greedy.json")
    assert "  bench qwen3.5-4b B=64: skipped (under 20 s left), 0.0 s" in lines
