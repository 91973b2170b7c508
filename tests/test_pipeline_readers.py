"""The output directory is a Parquet dataset to every standard reader: while
a job runs, after kill -9 before its resume, and once it is done, each reads
exactly the complete parts' rows, every input id at most once (exactly once
when done)."""

import json
import shutil
import time

import pyarrow.parquet as pq
import pytest
from conftest import invoke, write_job, write_parquet
from test_pipeline_resume import kill_at

ROWS = 24


def _ids(out):
    """The ids each reader sees in `out`, by reader."""
    import datasets
    import duckdb
    import pandas
    import polars
    import pyarrow.dataset as ds

    out = str(out)
    return {
        "pandas": pandas.read_parquet(out)["id"].tolist(),
        "pyarrow.read_table": pq.read_table(out).column("id").to_pylist(),
        "pyarrow.dataset": ds.dataset(out, format="parquet").to_table().column("id").to_pylist(),
        "datasets": datasets.load_dataset("parquet", data_dir=out, split="train")["id"],
        "polars": polars.read_parquet(f"{out}/*.parquet")["id"].to_list(),
        "duckdb": [r[0] for r in duckdb.sql(f"SELECT id FROM read_parquet('{out}/**/*.parquet')").fetchall()],
    }


def _job(tmp_path, model, out, rows=ROWS, flush_rows=4):
    inp = write_parquet(
        tmp_path / "in.parquet", id=[f"r{i}" for i in range(rows)], prompt=[f"p {i}" for i in range(rows)]
    )
    return write_job(
        tmp_path / "job.toml",
        f'[model]\npath = "{model}"\ndepth = 2\n[input]\npath = "{inp}"\n[prompt]\ncolumn = "prompt"\n'
        f"[generation]\nmax_tokens = 10\n[batch]\nmax_batch = 4\nwindow = 8\nread_rows = 8\n"
        f'[output]\npath = "{out}"\nflush_rows = {flush_rows}\n',
    )


def _assert_every_reader_sees(out, expected_ids, exactly: bool):
    for reader, ids in _ids(out).items():
        assert len(ids) == len(set(ids)), f"{reader}: an id twice"
        if exactly:
            assert sorted(ids) == sorted(expected_ids), reader
        else:
            assert set(ids) <= set(expected_ids), reader


def test_every_reader_reads_a_finished_job_as_its_rows_exactly_once(tmp_path, tiny_model):
    out = tmp_path / "out"
    assert invoke("run", _job(tmp_path, tiny_model, out)).exit_code == 0
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == sorted(
        p.name for p in out.glob("part-*.parquet")
    )  # nothing but parts in sight: the manifest, summary and lock are hidden
    assert (out / ".mtplx" / "manifest.json").is_file() and (out / ".mtplx" / "summary.json").is_file()
    _assert_every_reader_sees(out, [f"r{i}" for i in range(ROWS)], exactly=True)


def test_every_reader_reads_a_job_killed_mid_write_and_then_resumed(tmp_path, tiny_model):
    out = tmp_path / "out"
    job = _job(tmp_path, tiny_model, out, rows=48, flush_rows=2)
    expected = [f"r{i}" for i in range(48)]
    assert kill_at(job, out, min_parts=2, delay=0.05)
    (out / ".part-00999.parquet.tmp").write_bytes(b"PAR1 half a part")  # as a kill mid-write leaves one
    assert not (out / ".mtplx" / "summary.json").exists()
    _assert_every_reader_sees(out, expected, exactly=False)
    assert invoke("run", job).exit_code == 0
    assert not list(out.glob(".*.tmp"))
    _assert_every_reader_sees(out, expected, exactly=True)


def test_every_reader_reads_a_job_while_it_runs(tmp_path, tiny_model):
    import subprocess
    import sys

    from conftest import REPO, cli_env

    out = tmp_path / "out"
    job = _job(tmp_path, tiny_model, out, rows=64, flush_rows=2)
    p = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "run", str(job), "--quiet"], cwd=REPO, env=cli_env())
    try:
        deadline = time.monotonic() + 240
        while p.poll() is None and len(list(out.glob("part-*.parquet"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        _assert_every_reader_sees(out, [f"r{i}" for i in range(64)], exactly=False)
    finally:
        assert p.wait(timeout=300) == 0


def test_a_directory_of_the_layout_before_dot_mtplx_resumes_and_moves_its_manifest(tmp_path, tiny_model):
    out = tmp_path / "out"
    job = _job(tmp_path, tiny_model, out)
    assert invoke("run", job).exit_code == 0
    first = sorted(_ids(out)["pyarrow.read_table"])
    # the old layout: manifest and summary beside the parts, and one part missing
    for name in ("manifest.json", "summary.json"):
        shutil.move(out / ".mtplx" / name, out / name)
    (out / ".mtplx").rmdir()
    sorted(out.glob("part-*.parquet"))[-1].unlink()
    r = invoke("run", job)
    assert r.exit_code == 0, r.output
    assert not (out / "manifest.json").exists() and not (out / "summary.json").exists()
    assert json.loads((out / ".mtplx" / "summary.json").read_text())["rows"] == ROWS
    assert sorted(_ids(out)["pyarrow.read_table"]) == first


@pytest.mark.parametrize("legacy", [False, True])
def test_inspect_counts_rows_done_against_the_rows_a_stopped_job_will_have(tmp_path, tiny_model, legacy):
    out = tmp_path / "out"
    job = _job(tmp_path, tiny_model, out)
    assert invoke("run", job).exit_code == 0
    (out / ".mtplx" / "summary.json").unlink()
    sorted(out.glob("part-*.parquet"))[0].unlink()  # 4 rows a part
    if legacy:  # a manifest of before, which did not count the rows
        manifest = json.loads((out / ".mtplx" / "manifest.json").read_text())
        del manifest["output_rows"]
        (out / ".mtplx" / "manifest.json").write_text(json.dumps(manifest))
    r = invoke("inspect", out)
    assert r.exit_code == 0
    done = f"{ROWS - 4} rows done" if legacy else f"{ROWS - 4} of {ROWS} rows done"
    assert f"incomplete: {done}" in r.stdout
