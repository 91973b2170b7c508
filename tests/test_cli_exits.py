"""What a user meets first: the CLI runs the installed code whatever folder it
starts in, a bug exits with its own code and one line, and a mistake in the
job is refused before any row is written."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from conftest import REPO, invoke, write_job, write_parquet

from pipeline.errors import EXIT_BAD_JOB, EXIT_CRASH

MTPLX = Path(sys.executable).parent / "mtplx"


def _job(tmp_path, model, inp, out, extra="", prompt='column = "prompt"'):
    return write_job(
        tmp_path / "job.toml",
        f'[model]\npath = "{model}"\n[input]\npath = "{inp}"\n[prompt]\n{prompt}\n'
        f'[generation]\nmax_tokens = 4\n[output]\npath = "{out}"\n{extra}',
    )


def _prompts(tmp_path, **columns):
    columns = columns or {"id": ["a", "b", "c"], "prompt": ["x y", "z", "w v"]}
    return write_parquet(tmp_path / "in.parquet", **columns)


# ------------------------------------------------ the command, from any folder


def _run_from(cwd: Path, *args) -> subprocess.CompletedProcess:
    """The installed `mtplx` script as a user runs it: no preload set yet, so it
    re-executes itself with one (where the libraries exist)."""
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "MTPLX_PRELOAD_REEXEC_DONE")}
    env["PYTHONPATH"] = str(REPO)  # this checkout, as its editable install would give
    return subprocess.run([str(MTPLX), *map(str, args)], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(not MTPLX.exists(), reason="needs the installed mtplx script")
@pytest.mark.parametrize("package", ["mtplx", "pipeline"])
def test_the_command_run_from_a_folder_holding_a_package_of_the_same_name_runs_the_installed_one(tmp_path, package):
    (tmp_path / package).mkdir()
    (tmp_path / package / "__init__.py").write_text("raise SystemExit('imported the wrong package')")
    (tmp_path / package / "cli.py").write_text("raise SystemExit('imported the wrong package')")
    r = _run_from(tmp_path, "inspect-model")
    assert r.returncode == 0, r.stderr
    assert "wrong package" not in r.stdout + r.stderr and "qwen3_5" in r.stdout


# ------------------------------------------------------- unexpected failures


def test_a_failure_inside_a_job_exits_70_with_one_line_and_its_traceback_in_the_output_dir(
    tmp_path, tiny_model, monkeypatch
):
    import pipeline.runner

    def broken(*args, **kwargs):
        raise RuntimeError("injected fault")

    monkeypatch.setattr(pipeline.runner, "run_locally", broken)
    out = tmp_path / "out"
    r = invoke("run", _job(tmp_path, tiny_model, _prompts(tmp_path), out))
    assert r.exit_code == EXIT_CRASH not in (0, 1, 2)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "internal error: RuntimeError: injected fault" in lines[0], lines
    log = Path(re.search(r"traceback in (\S+);", lines[0]).group(1))
    assert log.parent == out / ".mtplx" and "Traceback" in log.read_text() and "injected fault" in log.read_text()


def test_a_failure_before_there_is_an_output_dir_prints_its_traceback_and_exits_70(tmp_path, tiny_model, monkeypatch):
    import pipeline.runner

    def broken(*args, **kwargs):
        raise KeyError("injected")

    monkeypatch.setattr(pipeline.runner, "prepare", broken)
    r = invoke("run", _job(tmp_path, tiny_model, _prompts(tmp_path), tmp_path / "out"))
    assert r.exit_code == EXIT_CRASH
    assert r.stderr.startswith("mtplx: internal error: KeyError") and "Traceback" in r.stderr


# ------------------------------------------------------------------ bad jobs


def _refused(tmp_path, job, out, words):
    for args in (["run", job], ["run", job, "--dry-run"]):
        r = invoke(*args)
        assert r.exit_code == EXIT_BAD_JOB, (args, r.output)
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert len(lines) == 1 and all(w in lines[0] for w in words), lines
        assert not list(out.glob("part-*.parquet")) and not (out / ".mtplx" / "manifest.json").exists()


def test_max_tokens_past_the_models_context_is_a_bad_job(tmp_path, tiny_model):
    out = tmp_path / "out"
    job = _job(tmp_path, tiny_model, _prompts(tmp_path), out).read_text().replace("max_tokens = 4", "max_tokens = 2048")
    _refused(tmp_path, write_job(tmp_path / "j.toml", job), out, ["max_tokens 2048", "2048 tokens"])


@pytest.mark.parametrize("values, kind", [([12, 13], "int64"), ([b"a", b"b"], "binary")])
def test_a_prompt_column_of_ints_or_bytes_is_a_bad_job(tmp_path, tiny_model, values, kind):
    # Formerly every such row became a row error; the column's type is the job's mistake.
    out = tmp_path / "out"
    inp = _prompts(tmp_path, id=["a", "b"], prompt=values)
    _refused(tmp_path, _job(tmp_path, tiny_model, inp, out), out, ["[prompt] column 'prompt'", kind])


def test_an_invalid_regex_reference_gives_its_row_an_error_naming_the_pattern(tmp_path, tiny_model):
    out = tmp_path / "out"
    inp = _prompts(tmp_path, id=["a", "b"], prompt=["x", "y"], answer=["a(b", "x"])
    evaluation = '[evaluation]\nreference_column = "answer"\nscorer = "regex"\n'
    r = invoke("run", _job(tmp_path, tiny_model, inp, out, extra=evaluation))
    assert r.exit_code == 1 and "1 row errors" in r.stderr
    rows = {r["id"]: r for r in pq.read_table(out).to_pylist()}
    assert "'a(b' is not a valid regular expression" in rows["a"]["error"] and rows["a"]["score"] is None
    assert rows["a"]["completion"] is not None  # the completion stands
    assert rows["b"]["error"] is None and rows["b"]["score"] in (0.0, 1.0)


# -------------------------------------------------------------- small frictions


def test_mtplx_load_without_a_path_or_with_default_loads_the_built_in_model():
    import mtplx

    assert mtplx.load().path == mtplx.load("default").path == mtplx.default_model_path()


def test_a_toml_job_keys_rows_by_the_inputs_id_column_when_it_has_one(tmp_path, tiny_model):
    out = tmp_path / "out"
    r = invoke("run", _job(tmp_path, tiny_model, _prompts(tmp_path), out))
    assert r.exit_code == 0, r.output
    table = pq.read_table(out)
    assert sorted(table.column("id").to_pylist()) == ["a", "b", "c"] and "row_index" not in table.column_names
    # and it says so before loading: the model's path and size, then how long loading took
    assert re.search(r"loading model \S+ \([\d.]+ [KMG]?B on disk\)", r.stderr)
    assert re.search(r"ready in [\d.]+ s", r.stderr)


def test_an_output_dir_keyed_by_row_index_before_the_id_default_keeps_resuming_by_row_index(tmp_path, tiny_model):
    out = tmp_path / "out"
    inp = _prompts(tmp_path)
    by_index = _job(tmp_path, tiny_model, inp, out).read_text().replace("[prompt]", 'id_column = ""\n[prompt]')
    assert invoke("run", write_job(tmp_path / "old.toml", by_index)).exit_code == 0
    sorted(out.glob("part-*.parquet"))[0].unlink()
    manifest = json.loads((out / ".mtplx" / "manifest.json").read_text())
    assert "row_index" in manifest["schema"]
    r = invoke("run", _job(tmp_path, tiny_model, inp, out))  # id_column unset, the input has `id`
    assert r.exit_code == 0, r.output
    assert sorted(pq.read_table(out).column("row_index").to_pylist()) == [0, 1, 2]


def test_generate_help_lists_every_flag():
    r = invoke("generate", "--help")
    usage = r.stdout.split("Options:")[0]
    flags = set(re.findall(r"(--[a-z-]+)", r.stdout.split("Options:")[1])) - {"--help"}
    assert flags and all(f in usage for f in flags), flags - set(re.findall(r"--[a-z-]+", usage))


def test_the_project_declares_its_license_as_an_spdx_string():
    text = (REPO / "pyproject.toml").read_text()
    assert re.search(r'^license = "MIT"$', text, re.M) and "setuptools>=77" in text
