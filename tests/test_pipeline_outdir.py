"""The output directory as one run's: a second run at once is refused,
--overwrite removes nothing until the job is ready to write, parts holding a
row twice are refused, and an output directory inside the input directory
is not read back as input."""

import os
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from conftest import invoke, write_job, write_parquet

PROMPTS = ["the cat sat", "a dog ran", "the sun is", "hello there"]


def make_job(tmp_path, model, out=None, inp=None, name="j"):
    inp = inp or write_parquet(tmp_path / "in.parquet", id=[f"r{i}" for i in range(len(PROMPTS))], prompt=PROMPTS)
    out = out or tmp_path / "out"
    text = (
        f'[model]\npath = "{model}"\n[input]\npath = "{inp}"\nid_column = "id"\n[prompt]\ncolumn = "prompt"\n'
        f'[generation]\nmax_tokens = 3\n[output]\npath = "{out}"\nflush_rows = 1\n'
    )
    return write_job(tmp_path / f"{name}.toml", text), out


def snapshot(out):
    """Every file the previous run left, with its bytes."""
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def one_line(r):
    """The one error line of a bad job (info lines such as "loading model" may come before it)."""
    assert r.exit_code == 2, r.output
    errors = [ln for ln in r.stderr.strip().splitlines() if ln.startswith("mtplx: error:")]
    assert len(errors) == 1 and "Traceback" not in r.stderr, r.stderr
    return errors[0]


def test_a_run_on_an_output_directory_another_run_holds_is_refused_and_writes_nothing(tmp_path, tiny_model):
    from pipeline.outdir import output_lock

    job, out = make_job(tmp_path, tiny_model)
    with output_lock(out):  # what a run in another process holds from its resume scan to its summary
        line = one_line(invoke("run", job))
        assert "in use by another run" in line and f"pid {os.getpid()}" in line
        assert "in use" in one_line(invoke("run", job, "--dry-run"))
        assert not list(out.glob("part-*")) and not (out / ".mtplx" / "manifest.json").exists()
    r = invoke("run", job)  # released, as the kernel releases it when its holder dies (kill -9 too)
    assert r.exit_code == 0, r.output
    assert pq.read_table(sorted(out.glob("part-*.parquet"))).num_rows == len(PROMPTS)


def test_overwrite_keeps_the_previous_output_when_the_job_fails_before_writing(tmp_path, tiny_model):
    job, out = make_job(tmp_path, tiny_model)
    assert invoke("run", job).exit_code == 0
    before = snapshot(out)
    assert any(name.startswith("part-") for name in before) and ".mtplx/summary.json" in before
    assert "too small" in one_line(invoke("run", job, "--overwrite", "--max-memory", "100KB"))
    assert snapshot(out) == before
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model, broken)
    shard = sorted(broken.glob("*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:-64])
    assert "cannot load model" in one_line(invoke("run", job, "--overwrite", "--model", broken))
    assert snapshot(out) == before
    r = invoke("run", job, "--overwrite")
    assert r.exit_code == 0, r.output
    assert pq.read_table(sorted(out.glob("part-*.parquet"))).num_rows == len(PROMPTS)


def test_dry_run_refuses_a_memory_cap_too_small_for_the_model(tmp_path, tiny_model):
    job, out = make_job(tmp_path, tiny_model)
    assert "too small" in one_line(invoke("run", job, "--dry-run", "--max-memory", "100KB"))
    r = invoke("run", job, "--dry-run", "--max-memory", "1GB")
    assert r.exit_code == 0, r.output
    assert not out.exists()


def test_resume_refuses_parts_that_hold_a_row_twice(tmp_path, tiny_model):
    job, out = make_job(tmp_path, tiny_model)
    assert invoke("run", job).exit_code == 0
    first = sorted(out.glob("part-*.parquet"))[0]
    shutil.copy(first, out / "part-00099.parquet")  # as two runs at once could leave them
    line = one_line(invoke("run", job))
    assert "more than once" in line and "--overwrite" in line
    r = invoke("run", job, "--overwrite")
    assert r.exit_code == 0, r.output
    ids = pq.read_table(sorted(out.glob("part-*.parquet"))).column("id").to_pylist()
    assert sorted(ids) == sorted(f"r{i}" for i in range(len(PROMPTS)))


def test_an_output_directory_inside_the_input_directory_resumes_without_reading_its_parts(tmp_path, tiny_model):
    data = tmp_path / "data"
    write_parquet(data / "in.parquet", id=[f"r{i}" for i in range(len(PROMPTS))], prompt=PROMPTS)
    job, out = make_job(tmp_path, tiny_model, out=data / "out", inp=data)
    r = invoke("run", job)
    assert r.exit_code == 0, r.output
    first = snapshot(out)
    (out / ".mtplx" / "summary.json").unlink()  # as a run killed before its summary leaves it
    r = invoke("run", job)
    assert r.exit_code == 0, r.output
    assert {k: v for k, v in snapshot(out).items() if k.startswith("part-")} == {
        k: v for k, v in first.items() if k.startswith("part-")
    }
    line = one_line(invoke("generate", "--input", data, "--output", data, "--model", tiny_model))
    assert "is the input" in line


def test_dry_run_refuses_an_output_directory_where_no_file_can_be_created(tmp_path, tiny_model):
    if not Path("/proc/self").is_dir():
        pytest.skip("needs /proc, where os.access allows root what the filesystem refuses")
    job, _ = make_job(tmp_path, tiny_model, out=Path("/proc/mtplx-out"))
    assert "cannot write to output directory /proc/mtplx-out" in one_line(invoke("run", job, "--dry-run"))
