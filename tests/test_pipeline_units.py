"""The pipeline's parts on their own: keys, packer, writer, signals, summary
totals, and resume logic driven by a fake engine."""

import json
import os
import signal
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import fake_engine_factory, write_parquet

from pipeline.errors import JobError
from pipeline.ids import KeySet, check_ids, id_hashes, row_keys
from pipeline.packer import length_ordered
from pipeline.reader import PromptRow
from pipeline.runner import RunOptions, run_job
from pipeline.signals import JobInterrupted, Stopper
from pipeline.spec import spec_from_dict
from pipeline.summary import Totals
from pipeline.writer import PartWriter


def prow(ordinal, length, error=None):
    return PromptRow(
        ordinal=ordinal,
        template_index=0,
        id=ordinal,
        values={},
        tokens=None if error else [1] * length,
        text=None,
        error=error,
        todo=(0,),
    )


# ---------------------------------------------------------------- keys


def test_row_keys_separate_ids_templates_and_samples():
    ids = id_hashes(pa.array(["a", "b", "c"]))
    keys = np.concatenate([row_keys(ids, t, s) for t in range(3) for s in range(4)])
    assert len(set(keys.tolist())) == 36
    ints = id_hashes(pa.array([0, 1, -1, 2**40], pa.int64()))
    assert len(set(row_keys(ints, 0, 0).tolist())) == 4


def test_keyset_membership_is_exact_for_the_keys_it_holds():
    rng = np.random.default_rng(0)
    held = rng.integers(0, 2**63, 1000, dtype=np.uint64)
    other = rng.integers(0, 2**63, 1000, dtype=np.uint64)
    ks = KeySet([held[:500], held[500:]])
    assert ks.contains(held).all() and not ks.contains(np.setdiff1d(other, held)).any()
    assert not KeySet().contains(held).any()


def test_check_ids_finds_nulls_and_duplicates_across_batches():
    def batches(*cols):
        return lambda: iter(pa.record_batch([pa.array(c)], names=["id"]) for c in cols)

    assert check_ids(batches([1, 2], [3]), "id", "in") == 3
    with pytest.raises(JobError, match="rows 0 and 2 share id 1"):
        check_ids(batches([1, 2], [1]), "id", "in")
    with pytest.raises(JobError, match="null ids .first at row 3"):
        check_ids(batches(["a", "b"], ["c", None]), "id", "in")


# --------------------------------------------------------------- packer


def test_packer_sorts_by_length_within_each_window_and_passes_errors_on():
    rows = [prow(i, length) for i, length in enumerate([5, 3, 9, 1, 4, 4, 2])] + [prow(7, 0, error="bad")]
    errors = []
    out = [r.ordinal for r in length_ordered(iter(rows), 3, errors.append)]
    assert out == [1, 0, 2, 3, 4, 5, 6]  # windows [5,3,9] [1,4,4] [2]; ties keep input order
    assert [r.ordinal for r in errors] == [7]


def test_packer_brings_prompts_with_a_common_head_together_at_their_shortest_length():
    def row(ordinal, tokens):
        r = prow(ordinal, 0)
        r.tokens = tokens
        return r

    a, b = [7] * 8, [9] * 8  # two shared heads of 8 tokens
    rows = [row(0, a + [1] * 9), row(1, b + [2]), row(2, [3] * 5), row(3, a + [4]), row(4, b + [5] * 20), row(5, [6])]
    out = [r.ordinal for r in length_ordered(iter(rows), 10, lambda r: None, share_prefix_min=8)]
    # Without sharing: by length alone, the two heads' rows interleave.
    assert [r.ordinal for r in length_ordered(iter(rows), 10, lambda r: None)] == [5, 2, 1, 3, 0, 4]
    assert out == [5, 2, 1, 4, 3, 0]  # b's group at length 9, a's at 9 too (later in input), each by length


def test_packer_pulls_no_more_than_one_window_ahead():
    pulled = []

    def source():
        for i in range(100):
            pulled.append(i)
            yield prow(i, 100 - i)

    it = length_ordered(source(), 10, lambda r: None)
    next(it)
    assert len(pulled) == 10


# --------------------------------------------------------------- writer


def test_writer_flushes_by_rows_and_by_time_and_renames_whole_parts(tmp_path):
    now = [0.0]
    schema = pa.schema([("x", pa.int64())])
    w = PartWriter(tmp_path, schema, 3, flush_rows=2, flush_seconds=10, clock=lambda: now[0])
    w.add({"x": 1})
    assert not list(tmp_path.iterdir())
    w.add({"x": 2})
    assert [p.name for p in tmp_path.iterdir()] == ["part-00003.parquet"]
    w.add({"x": 3})
    now[0] = 11.0
    w.add({"x": 4})  # 11 s since the last flush
    assert sorted(p.name for p in tmp_path.iterdir()) == ["part-00003.parquet", "part-00004.parquet"]
    assert pq.read_table(tmp_path / "part-00004.parquet").column("x").to_pylist() == [3, 4]
    assert w.rows_written == 4 and not list(tmp_path.glob(".*.tmp"))


def test_a_signal_during_a_part_write_is_held_until_the_part_is_whole(tmp_path):
    stopper = Stopper()
    stopper.install()
    try:
        w = PartWriter(tmp_path, pa.schema([("x", pa.int64())]), 0, flush_rows=100, flush_seconds=1e9, stopper=stopper)
        w.add({"x": 1})
        original = w._write_part

        def write_with_signal():
            os.kill(os.getpid(), signal.SIGTERM)  # arrives mid-write
            original()

        w._write_part = write_with_signal
        with pytest.raises(JobInterrupted):
            w.flush()
        assert pq.read_table(tmp_path / "part-00000.parquet").num_rows == 1
    finally:
        stopper.restore()


def test_a_second_signal_cannot_break_into_the_flush_after_the_first():
    # SIGTERM then SIGINT (or a double Ctrl-C): both pending at once, CPython
    # runs the second handler right after the first raises, before the runner
    # reaches its shielded final flush.
    stopper = Stopper()
    stopper.install()
    try:
        with pytest.raises(JobInterrupted) as first:
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)  # the handlers run between bytecodes: the first raises here
        assert first.value.signum == signal.SIGTERM and stopper.stopping
        os.kill(os.getpid(), signal.SIGINT)  # while the runner flushes
        with stopper.critical():
            pass  # leaving a critical section raises no held signal either
    finally:
        stopper.restore()


def test_a_signal_while_a_prompt_is_tokenized_stops_the_job_instead_of_failing_that_row():
    from pipeline.prompts import PromptEncoder
    from pipeline.spec import PromptSpec

    class SignalledTokenizer:  # the Stopper's handler raising inside a tokenizer call
        def encode(self, text, add_special_tokens=True):
            raise JobInterrupted(signal.SIGINT)

    encoder = PromptEncoder(PromptSpec(column="prompt"), SignalledTokenizer())
    with pytest.raises(JobInterrupted):
        encoder.build({"prompt": "hello"})


# -------------------------------------------------------------- summary


def test_totals_sum_ragged_acceptance_lists_by_depth():
    t = pa.table(
        {
            "error": [None, "boom", None],
            "finish_reason": ["stop", "error", "length"],
            "prompt_tokens": [3, 4, 5],
            "completion_tokens": [6, 0, 4],
            "drafted_by_depth": [[4, 4], [], [3, 3, 3]],
            "accepted_by_depth": [[2, 1], [], [3, 2, 0]],
            "mean_accepted_length": [1.75, None, 2.0],
            "decode_steps": [4, 0, 3],
        }
    )
    tot = Totals()
    tot.add_part(t)
    m = tot.metrics()
    assert [(d["drafted"], d["accepted"]) for d in m["acceptance_by_depth"]] == [(7, 5), (7, 3), (3, 0)]
    assert m["errors"] == 1 and m["rows"] == 3 and m["finish_reasons"] == {"error": 1, "length": 1, "stop": 1}
    assert m["prompt_tokens"] == 12 and m["undecoded_prompt_tokens"] == 4  # the row that failed before decoding
    assert m["acceptance_rate"] == pytest.approx(8 / 17)
    assert m["mean_accepted_length"] == pytest.approx((1.75 * 4 + 2.0 * 3) / 7)


# ------------------------------------------------- resume with a fake engine


def fake_spec(tmp_path, inp, **extra):
    doc = {
        "model": {"path": str(tmp_path / "model")},
        "input": {"path": str(inp), "id_column": "id"},
        "prompt": {"column": "prompt"},
        "generation": {"max_tokens": 6},
        "output": {"path": str(tmp_path / "out"), "flush_rows": 2},
    }
    for k, v in extra.items():
        doc[k] = {**doc.get(k, {}), **v}
    return spec_from_dict(doc)


@pytest.fixture
def fake_model_dir(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")


def run_fake(spec, **opts):
    return run_job(spec, RunOptions(quiet=True, **opts), engine_factory=fake_engine_factory(), log=lambda s: None)


def read_out(tmp_path):
    return pq.read_table(sorted((tmp_path / "out").glob("part-*.parquet"))).to_pylist()


def test_resume_fills_in_exactly_the_missing_samples(tmp_path, fake_model_dir):
    inp = write_parquet(tmp_path / "in.parquet", id=[10, 11, 12, 13], prompt=["a", "bb", "ccc", "dddd"])
    spec = fake_spec(tmp_path, inp, generation={"n": 3}, sampling={"temperature": 1.0})
    assert run_fake(spec).exit_code == 0
    full = {(r["id"], r["sample_index"]): r["completion"] for r in read_out(tmp_path)}
    assert len(full) == 12
    # drop some parts: their rows, including single samples of a prompt, are missing
    parts = sorted((tmp_path / "out").glob("part-*.parquet"))
    for p in parts[1::2]:
        p.unlink()
    (tmp_path / "out" / ".part-00099.parquet.tmp").write_bytes(b"half a part")
    (tmp_path / "out" / ".mtplx" / "summary.json").unlink()
    result = run_fake(spec)
    assert result.exit_code == 0 and result.summary["rows"] == 12
    again = [((r["id"], r["sample_index"]), r["completion"]) for r in read_out(tmp_path)]
    assert len(again) == 12 and dict(again) == full
    assert not list((tmp_path / "out").glob(".*.tmp"))


def test_rerunning_a_finished_job_adds_nothing(tmp_path, fake_model_dir):
    inp = write_parquet(tmp_path / "in.parquet", id=["a", "b"], prompt=["x", "y"])
    spec = fake_spec(tmp_path, inp)
    run_fake(spec)
    names = sorted(p.name for p in (tmp_path / "out").iterdir())
    result = run_fake(spec)
    assert result.summary["rows_this_run"] == 0 and result.summary["rows"] == 2
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == names


def test_rerunning_a_finished_job_draws_no_progress_bar(tmp_path, fake_model_dir, capsys):
    inp = write_parquet(tmp_path / "in.parquet", id=["a", "b"], prompt=["x", "y"])
    spec = fake_spec(tmp_path, inp)
    run_job(spec, RunOptions(quiet=False), engine_factory=fake_engine_factory(), log=lambda s: None)
    assert "2/2" in capsys.readouterr().err  # the first run's bar
    run_job(spec, RunOptions(quiet=False), engine_factory=fake_engine_factory(), log=lambda s: None)
    assert "row" not in capsys.readouterr().err


def run_with_context(spec, max_context, **opts):
    return run_job(
        spec, RunOptions(quiet=True, **opts), engine_factory=fake_engine_factory(max_context), log=lambda s: None
    )


def test_retry_errors_runs_again_only_the_rows_written_with_an_error(tmp_path, fake_model_dir):
    inp = write_parquet(tmp_path / "in.parquet", id=[10, 11, 12, 13], prompt=["a", "dddd", "cc", "eeee"])
    spec = fake_spec(tmp_path, inp)
    first = run_with_context(spec, max_context=9)  # prompts of 4 tokens + max_tokens 6 do not fit
    assert first.summary["errors"] == 2
    before = {r["id"]: r for r in read_out(tmp_path)}
    assert all(before[i]["error"] for i in (11, 13)) and not before[10]["error"]

    kept = run_with_context(spec, max_context=None)  # a plain resume keeps the error rows
    assert kept.summary["rows_this_run"] == 0 and kept.summary["errors"] == 2

    again = run_with_context(spec, max_context=None, retry_errors=True)
    assert again.summary["rows_this_run"] == 2 and again.summary["errors"] == 0 and again.summary["rows"] == 4
    after = read_out(tmp_path)
    assert sorted(r["id"] for r in after) == [10, 11, 12, 13]
    by_id = {r["id"]: r for r in after}
    assert by_id[10] == before[10] and by_id[12] == before[12]
    assert by_id[11]["completion"] and by_id[13]["completion"]


def test_retry_errors_killed_while_dropping_error_rows_loses_and_repeats_nothing(tmp_path, fake_model_dir, monkeypatch):
    import pipeline.outdir as outdir

    inp = write_parquet(tmp_path / "in.parquet", id=list(range(8)), prompt=["dddd", "a"] * 4)
    spec = fake_spec(tmp_path, inp)  # flush_rows 2: the 4 error rows spread over several parts
    assert run_with_context(spec, max_context=9).summary["errors"] == 4
    real, calls = outdir.drop_error_rows, []

    def dies_on_the_second_part(part):
        calls.append(part)
        if len(calls) == 2:
            raise RuntimeError("killed")
        real(part)

    monkeypatch.setattr(outdir, "drop_error_rows", dies_on_the_second_part)
    with pytest.raises(RuntimeError, match="killed"):
        run_with_context(spec, max_context=None, retry_errors=True)
    assert len(calls) == 2  # the first part was rewritten, the second not
    monkeypatch.setattr(outdir, "drop_error_rows", real)
    done = run_with_context(spec, max_context=None, retry_errors=True)
    ids = sorted(r["id"] for r in read_out(tmp_path))
    assert ids == list(range(8)) and done.summary["errors"] == 0


def test_part_files_without_a_manifest_are_not_resumed(tmp_path, fake_model_dir):
    inp = write_parquet(tmp_path / "in.parquet", id=["a"], prompt=["x"])
    spec = fake_spec(tmp_path, inp)
    run_fake(spec)
    (tmp_path / "out" / ".mtplx" / "manifest.json").unlink()
    with pytest.raises(JobError, match="no manifest.json"):
        run_fake(spec)
    assert run_fake(spec, overwrite=True).exit_code == 0


def test_changed_input_data_is_refused(tmp_path, fake_model_dir):
    inp = write_parquet(tmp_path / "in.parquet", id=["a", "b"], prompt=["x", "y"])
    spec = fake_spec(tmp_path, inp)
    run_fake(spec)
    write_parquet(inp, id=["a", "b", "c"], prompt=["x", "y", "z"])
    with pytest.raises(JobError, match="the input data changed"):
        run_fake(spec)


def test_memory_cap_shrinks_slots_and_refuses_below_the_weights(tiny_model):
    import mtplx
    from pipeline.memory import footprint, size_runtime

    model = mtplx.load(tiny_model)
    spec = spec_from_dict(
        {"input": {"path": "x"}, "prompt": {"column": "p"}, "output": {"path": "o"}, "batch": {"max_batch": 64}}
    )
    fp = footprint(model, spec)
    roomy = size_runtime(model, spec, 100 * fp.total(64, 512))
    tight = size_runtime(model, spec, fp.total(4, 512) + 1)
    assert roomy.max_batch == 64 and 1 <= tight.max_batch <= 4 and tight.estimated_bytes <= fp.total(4, 512) + 1
    with pytest.raises(JobError, match="too small"):
        size_runtime(model, spec, fp.weights // 2)


def test_a_signal_while_the_summary_is_written_waits_for_it_then_exits_143(tmp_path, fake_model_dir, monkeypatch):
    import pipeline.job as runner

    inp = write_parquet(tmp_path / "in.parquet", id=[1, 2, 3], prompt=["a", "bb", "ccc"])
    original = runner.build_summary

    def build_with_signal(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)  # arrives after the last row, mid-summary
        return original(*args, **kwargs)

    monkeypatch.setattr(runner, "build_summary", build_with_signal)
    before = signal.getsignal(signal.SIGTERM)
    result = run_fake(fake_spec(tmp_path, inp))
    assert result.exit_code == 128 + signal.SIGTERM
    assert result.summary["rows"] == 3 and "interrupted by SIGTERM after the last row" in result.warnings[-1]
    assert json.loads((tmp_path / "out" / ".mtplx" / "summary.json").read_text())["rows"] == 3
    assert signal.getsignal(signal.SIGTERM) == before


def test_an_engine_factory_of_three_arguments_still_runs_a_fixed_depth_job(tmp_path, fake_model_dir):
    spec = spec_from_dict(
        {
            "model": {"path": str(tmp_path / "model"), "depth": 2},
            "input": {"path": str(write_parquet(tmp_path / "in.parquet", prompt=["ab", "cd"]))},
            "prompt": {"column": "prompt"},
            "generation": {"max_tokens": 3},
            "output": {"path": str(tmp_path / "out")},
        }
    )
    fake = fake_engine_factory()
    result = run_job(
        spec,
        RunOptions(quiet=True),
        engine_factory=lambda ref, spec, max_memory: fake(ref, spec, max_memory),
        log=lambda s: None,
    )
    assert result.exit_code == 0 and result.summary["rows"] == 2


def test_progress_bar_ends_on_the_final_counts(capsys):
    from pipeline.progress import Progress

    bar = Progress(3, quiet=False)
    bar.row(5, 4, 2, error=False)  # the first row sets the postfix; the next two come within its 0.5 s
    bar.row(0, 0, 0, error=True)
    bar.row(0, 0, 0, error=True)
    bar.close()
    last = capsys.readouterr().err.replace("\r", "\n").strip().splitlines()[-1]
    assert "3/3" in last and "errors 2" in last and "acc 0.50" in last
