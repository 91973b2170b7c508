"""The shipped job specs load, validate against jobs/data and run.

They name the built-in default model; until it ships, they run here on the
tiny checkpoint (`--model`)."""

from dataclasses import replace

import pytest
from conftest import REPO, invoke

from pipeline.runner import RunOptions, run_job
from pipeline.spec import load_spec

JOBS = ["nightly", "synthesize", "evaluate", "fewshot"]


@pytest.mark.parametrize("name", JOBS)
def test_job_spec_dry_runs_on_jobs_data(name, tiny_model, tmp_path):
    job = REPO / "jobs" / f"{name}.toml"
    if not (REPO / "jobs" / "data").exists():
        pytest.skip("jobs/data not generated (python jobs/make_data.py)")
    r = invoke("run", job, "--dry-run", "--model", tiny_model, "--output", tmp_path / "out")
    assert r.exit_code == 0, r.output
    assert "row errors seen already: 0" in r.stdout
    assert not (tmp_path / "out").exists()


def test_job_specs_use_the_default_model_and_write_under_out():
    for name in JOBS:
        spec = load_spec(REPO / "jobs" / f"{name}.toml")
        assert spec.model.path is None and spec.name == name
        assert spec.output.path == str(REPO / "out" / name)


def test_evaluate_job_reports_accuracy(tiny_model, tmp_path):
    if not (REPO / "jobs" / "data").exists():
        pytest.skip("jobs/data not generated (python jobs/make_data.py)")
    import pyarrow.parquet as pq

    spec = load_spec(REPO / "jobs" / "evaluate.toml")
    subset = tmp_path / "subset.parquet"  # 16 rows keep the tiny model's prefill short
    pq.write_table(pq.read_table(spec.input.path).slice(0, 16), subset)
    spec = replace(
        spec,
        model=replace(spec.model, path=str(tiny_model)),
        input=replace(spec.input, path=str(subset)),
        generation=replace(spec.generation, max_tokens=2),
        output=replace(spec.output, path=str(tmp_path / "out")),
    )
    result = run_job(spec, RunOptions(quiet=True), log=lambda s: None)
    assert result.exit_code == 0
    s = result.summary
    assert s["rows"] == s["input_rows"] == s["scored_rows"] and 0.0 <= s["accuracy"] <= 1.0


def test_a_job_at_depth_auto_says_what_it_planned_and_records_it_in_the_summary(tiny_model, tmp_path):
    from conftest import write_parquet

    data = write_parquet(tmp_path / "in.parquet", id=[1, 2, 3], prompt=["ab", "abc", "b"])
    spec = load_spec(REPO / "jobs" / "nightly.toml")
    spec = replace(
        spec,
        model=replace(spec.model, path=str(tiny_model), depth="auto"),
        input=replace(spec.input, path=str(data), keep_columns=[]),
        generation=replace(spec.generation, max_tokens=4, stop=[]),
        batch=replace(spec.batch, max_batch=2),
        output=replace(spec.output, path=str(tmp_path / "out")),
    )
    lines = []
    result = run_job(spec, RunOptions(), log=lines.append)
    assert result.exit_code == 0, lines
    assert lines[0] == "nightly: depth auto: timing the decode passes on this machine first"
    assert lines[1].startswith("nightly: loading model ") and "ready in" in lines[2]
    plan = result.summary["runtime"]["stats"]["auto_depth"]
    assert lines[3] == f"nightly: depth auto: {plan['policy']}"
    assert sum(plan["cycles_by_depth"].values()) > 0 and "bare_costs" in plan


def test_a_resumed_auto_job_samples_at_the_depth_its_first_run_recorded(tiny_model, tmp_path):
    import json

    from conftest import write_parquet

    data = write_parquet(tmp_path / "in.parquet", id=[1, 2, 3, 4], prompt=["ab", "abc", "b", "ba"])
    spec = load_spec(REPO / "jobs" / "nightly.toml")
    spec = replace(
        spec,
        model=replace(spec.model, path=str(tiny_model), depth="auto"),
        input=replace(spec.input, path=str(data), keep_columns=[]),
        sampling=replace(spec.sampling, temperature=1.0),
        generation=replace(spec.generation, max_tokens=4, stop=[]),
        batch=replace(spec.batch, max_batch=2),
        output=replace(spec.output, path=str(tmp_path / "out")),
    )
    out = tmp_path / "out"
    first = run_job(spec, RunOptions(quiet=True), log=lambda s: None)
    chosen = first.summary["runtime"]["stats"]["auto_depth"]["depth"]
    manifest = json.loads((out / ".mtplx" / "manifest.json").read_text())
    assert manifest["auto_sampled_depth"] == chosen  # recorded when the first run wrote its manifest
    # A first run whose calibration chose another depth, and a part lost.
    other = (chosen + 1) % 4
    (out / ".mtplx" / "manifest.json").write_text(json.dumps({**manifest, "auto_sampled_depth": other}))
    for part in out.glob("part-*.parquet"):
        part.unlink()
    again = run_job(spec, RunOptions(quiet=True), log=lambda s: None)
    plan = again.summary["runtime"]["stats"]["auto_depth"]
    assert plan["depth"] == other and plan["depth_from"].startswith("given")
    assert json.loads((out / ".mtplx" / "manifest.json").read_text())["auto_sampled_depth"] == other
