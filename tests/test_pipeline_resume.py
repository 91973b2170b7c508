"""Resume: after kill -9 at random moments and a rerun, every input row is in
the output exactly once, with the completions of an uninterrupted run."""

import random
import signal
import subprocess
import sys
import time

import pyarrow.parquet as pq
import pytest
from conftest import REPO, cli_env, invoke, run_cli, write_job, write_parquet

ROWS = 64
MAX_DIFF = 0.01  # batch-shape float noise may flip a near-tie; zero is the aim


def make_inputs(tmp_path, rows=ROWS):
    words = ["the", "cat", "sat", "on", "a", "mat", "dog", "ran"]
    prompts = [" ".join(words[(i + j) % 8] for j in range(1 + i % 9)) + f" {i}" for i in range(rows)]
    return write_parquet(tmp_path / "in.parquet", id=[f"r{i}" for i in range(rows)], prompt=prompts)


def job_spec(tmp_path, model, inp, out, sampling: str, n: int, name: str):
    return write_job(
        tmp_path / f"{name}.toml",
        (
            f'[model]\npath = "{model}"\ndepth = 2\n[input]\npath = "{inp}"\nid_column = "id"\n'
            f'[prompt]\ncolumn = "prompt"\n[sampling]\n{sampling}\n[generation]\nmax_tokens = 12\nn = {n}\n'
            f'[batch]\nmax_batch = 4\nwindow = 8\nread_rows = 16\n[output]\npath = "{out}"\nflush_rows = 3\n'
        ),
    )


def parts(out):
    return sorted(out.glob("part-*.parquet"))


def rows_by_key(out, n):
    t = pq.read_table(parts(out))
    keys = list(zip(t.column("id").to_pylist(), t.column("sample_index").to_pylist() if n > 1 else [0] * t.num_rows))
    assert len(keys) == len(set(keys)), "a row appears more than once"
    cols = ("completion", "finish_reason", "completion_tokens")
    return dict(zip(keys, zip(*(t.column(c).to_pylist() for c in cols))))


def start(job):
    return subprocess.Popen(
        [sys.executable, "-m", "pipeline.cli", "run", str(job), "--quiet"],
        cwd=REPO,
        env=cli_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def kill_at(job, out, min_parts: int, delay: float) -> bool:
    """Start the job, wait for `min_parts` part files, then `delay` seconds,
    then SIGKILL. True when the process was still running when killed."""
    before = len(parts(out))
    p = start(job)
    deadline = time.monotonic() + 240
    while p.poll() is None and len(parts(out)) < before + min_parts and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(delay)
    alive = p.poll() is None
    p.kill()
    p.communicate(timeout=60)
    return alive


@pytest.mark.parametrize(
    "kind, sampling, n",
    [
        ("greedy", "temperature = 0.0", 1),
        ("sampled", "temperature = 0.9\ntop_p = 0.95\nseed = 11", 2),
    ],
)
def test_kill_9_at_random_points_then_rerun_equals_an_uninterrupted_run(tmp_path, tiny_model, kind, sampling, n):
    # 4x ROWS: a job of ROWS rows ended within 1.5 s of its start here, before
    # the first kill point (the CI-like run of 2026-12-01 at 33b69e2).
    rows = 4 * ROWS
    inp = make_inputs(tmp_path, rows)
    ref_out, out = tmp_path / "reference", tmp_path / "out"
    r = invoke("run", job_spec(tmp_path, tiny_model, inp, ref_out, sampling, n, "reference"), "--quiet")
    assert r.exit_code == 0, r.output
    reference = rows_by_key(ref_out, n)
    assert len(reference) == rows * n

    job = job_spec(tmp_path, tiny_model, inp, out, sampling, n, "job")
    rng = random.Random(f"{kind}-kill-points")
    # (parts to wait for, then seconds): during start-up, then twice a few parts in
    points = [
        (0, rng.uniform(0.5, 2.0)),
        (rng.randint(1, 5), rng.uniform(0.0, 0.05)),
        (rng.randint(1, 5), rng.uniform(0.0, 0.3)),
    ]
    killed_mid_run = 0
    for min_parts, delay in points:
        alive = kill_at(job, out, min_parts, delay)
        killed_mid_run += alive and not (out / ".mtplx" / "summary.json").exists()
        for p in parts(out):  # every part present is whole
            pq.read_metadata(p)
    print(
        f"{kind}: kill points {[(m, round(d, 3)) for m, d in points]}, {killed_mid_run} landed mid-run, "
        f"{len(parts(out))} parts before the final run"
    )
    assert killed_mid_run >= 2

    final = run_cli("run", job, "--quiet")
    assert final.returncode == 0, final.stderr
    assert not list(out.glob(".*.tmp"))
    resumed = rows_by_key(out, n)
    assert resumed.keys() == reference.keys()
    differing = sum(resumed[k] != reference[k] for k in reference)
    print(f"{kind}: {differing} of {len(reference)} rows differ from the uninterrupted run")
    assert differing <= MAX_DIFF * len(reference)


def test_sigterm_then_sigint_save_finished_rows_and_exit_128_plus_the_signal(tmp_path, tiny_model):
    # 4x the rows of the kill -9 test: the job runs seconds past its first part,
    # so the signal cannot land after the job has ended (a process already on its
    # way out ignores it and exits 0: the CI failure of 2026-11-29 at 35c58f9).
    rows = 4 * ROWS
    inp = make_inputs(tmp_path, rows)
    out = tmp_path / "out"
    job = job_spec(tmp_path, tiny_model, inp, out, "temperature = 0.0", 1, "job")
    p = start(job)
    deadline = time.monotonic() + 240
    while p.poll() is None and not parts(out) and time.monotonic() < deadline:
        time.sleep(0.01)
    if p.poll() is not None:
        pytest.skip("the job finished before the signal could be sent")
    p.send_signal(signal.SIGTERM)
    p.send_signal(signal.SIGINT)  # a second signal (a supervisor's, a user's) must not break the final flush
    _, err = p.communicate(timeout=60)
    # Both pending at once, the kernel hands over the lower-numbered first: either may be the one acted on.
    first = {128 + signal.SIGTERM: "SIGTERM", 128 + signal.SIGINT: "SIGINT"}.get(p.returncode)
    assert first is not None, err
    assert f"interrupted by {first}" in err and "Traceback" not in err
    assert not list(out.glob(".*.tmp")) and not (out / ".mtplx" / "summary.json").exists()
    done = pq.read_table(parts(out)).num_rows
    assert 0 < done < rows
    r = run_cli("run", job, "--quiet")
    assert r.returncode == 0, r.stderr
    assert sorted(pq.read_table(parts(out)).column("id").to_pylist()) == sorted(f"r{i}" for i in range(rows))
