"""Shared prompt prefixes through the pipeline: the setting in the spec and on
the CLI, the per-row column, summary.json, the progress bar, resume."""

import pyarrow.parquet as pq
import pytest
from conftest import invoke, write_parquet

from pipeline.errors import JobError
from pipeline.runner import RunOptions, run_job
from pipeline.spec import spec_from_dict

SHARED = "Answer in one word. " * 12  # a few-shot block every prompt begins with


def _spec(tiny_model, tmp_path, out="out", share=None):
    data = tmp_path / "in.parquet"
    if not data.exists():
        questions = ["a cat", "the dog", "x", "one more", "and", "zz top"]
        write_parquet(data, id=list(range(len(questions))), prompt=[SHARED + q for q in questions])
    doc = {
        "model": {"path": str(tiny_model), "depth": 2},
        "input": {"path": str(data), "id_column": "id"},
        "prompt": {"column": "prompt"},
        "generation": {"max_tokens": 6},
        "batch": {"max_batch": 4} | ({} if share is None else {"share_prefix_min": share}),
        "output": {"path": str(tmp_path / out)},
    }
    return spec_from_dict(doc)


def _rows(path):
    return sorted(pq.read_table(sorted(path.glob("part-*.parquet"))).to_pylist(), key=lambda r: r["id"])


def test_a_job_takes_shared_prefixes_once_records_them_and_writes_what_it_writes_without(tiny_model, tmp_path):
    shared = run_job(_spec(tiny_model, tmp_path, "on"), RunOptions(quiet=True), log=lambda s: None)
    alone = run_job(_spec(tiny_model, tmp_path, "off", share=0), RunOptions(quiet=True), log=lambda s: None)
    assert shared.exit_code == alone.exit_code == 0
    on, off = _rows(tmp_path / "on"), _rows(tmp_path / "off")
    assert [r["completion"] for r in on] == [r["completion"] for r in off]
    assert all(r["shared_prefix_tokens"] >= 64 for r in on) and all(r["shared_prefix_tokens"] == 0 for r in off)
    s, t = shared.summary, alone.summary
    assert s["shared_prefix_tokens"] == sum(r["shared_prefix_tokens"] for r in on)
    assert s["prompt_tokens"] == t["prompt_tokens"] == t["prefill_tokens"]
    # The block is computed once: the prompts less what rows took from it, plus itself.
    assert s["prompt_tokens"] - s["shared_prefix_tokens"] < s["prefill_tokens"] < s["prompt_tokens"] / 3
    assert s["runtime"]["share_prefix_min"] == 64 and t["runtime"]["share_prefix_min"] == 0


def test_share_prefix_min_may_change_between_a_run_and_its_resume(tiny_model, tmp_path):
    spec = _spec(tiny_model, tmp_path, share=0)
    assert spec.identity() == _spec(tiny_model, tmp_path, share=128).identity()  # not part of the spec hash
    first = run_job(spec, RunOptions(quiet=True), log=lambda s: None)
    again = run_job(spec, RunOptions(quiet=True, share_prefix_min=64), log=lambda s: None)  # the same output dir
    assert first.exit_code == again.exit_code == 0 and again.summary["rows_this_run"] == 0


def test_the_cli_option_overrides_the_spec_and_its_help_says_what_it_does(tiny_model, tmp_path):
    spec = _spec(tiny_model, tmp_path)
    job = tmp_path / "job.toml"
    job.write_text(
        f'[model]\npath = "{tiny_model}"\n[input]\npath = "{spec.input.path}"\n[prompt]\ncolumn = "prompt"\n'
        f'[generation]\nmax_tokens = 3\n[output]\npath = "{tmp_path / "cli"}"\n'
    )
    r = invoke("run", job, "--share-prefix-min", "0", "--quiet")
    assert r.exit_code == 0, r.output
    assert all(row["shared_prefix_tokens"] == 0 for row in _rows(tmp_path / "cli"))
    help_text = " ".join(invoke("generate", "--help").output.split())
    assert "--share-prefix-min" in help_text and "prefill them once" in help_text and "0 turns it off" in help_text


def test_a_negative_share_prefix_min_is_a_bad_job(tiny_model, tmp_path):
    with pytest.raises(JobError, match="share_prefix_min"):
        _spec(tiny_model, tmp_path, share=-1)


def test_the_progress_bar_shows_the_share_of_prompt_tokens_taken_from_shared_prefixes():
    from pipeline.progress import Progress

    p = Progress(2, quiet=True)
    p.row(5, 0, 0, False)
    assert "shared" not in p.postfix(p.start + 1)
    p.row(5, 0, 0, False, prompt_tokens=200, shared=150)
    assert p.postfix(p.start + 1).endswith("shared prefix 75%")


def test_a_memory_cap_bounds_the_prefix_cache_inside_it(tiny_model, tmp_path):
    import mtplx
    from pipeline.memory import size_runtime

    model = mtplx.load(tiny_model, lazy=True)
    spec = _spec(tiny_model, tmp_path)
    capped = size_runtime(model, spec, 200_000_000)
    assert 0 < capped.prefix_cache_bytes < 200_000_000 // 10 and capped.estimated_bytes <= 200_000_000
    assert capped.prefill_chunk % 16 == 0
    assert size_runtime(model, spec, None).prefix_cache_bytes is None  # the runtime's default bound
