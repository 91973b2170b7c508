"""Bad jobs exit 2 with one line naming the problem; bad rows become error
rows, the job goes on and exits 1. Never a traceback."""

import pyarrow.parquet as pq
import pytest
from conftest import invoke, run_cli, write_job, write_parquet

PROMPTS = ["the cat", "a dog is", "hello there", "one two three"]


def job_text(inp, out, model, extra="", prompt='column = "prompt"', id_line='id_column = "id"'):
    return (
        f'[model]\npath = "{model}"\n[input]\npath = "{inp}"\n{id_line}\n[prompt]\n{prompt}\n'
        f'[generation]\nmax_tokens = 4\n[output]\npath = "{out}"\n{extra}'
    )


def one_error_line(result) -> str:
    assert result.exit_code == 2, (result.exit_code, result.output)
    assert "Traceback" not in result.output
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, lines
    assert lines[0].startswith("mtplx: error: ")
    return lines[0]


def parts_rows(out):
    return pq.read_table(sorted(out.glob("part-*.parquet"))).to_pylist()


@pytest.fixture
def good_input(tmp_path):
    return write_parquet(tmp_path / "in.parquet", id=[f"r{i}" for i in range(4)], prompt=PROMPTS)


def test_missing_prompt_column_names_it_and_lists_the_present_ones(tmp_path, tiny_model):
    inp = write_parquet(tmp_path / "in.parquet", id=["a", "b"], text=["x", "y"])
    job = write_job(tmp_path / "j.toml", job_text(inp, tmp_path / "out", tiny_model))
    line = one_error_line(invoke("run", job))
    assert "'prompt'" in line and "columns: id, text" in line


def test_missing_id_column_names_it(tmp_path, tiny_model):
    inp = write_parquet(tmp_path / "in.parquet", key=["a", "b"], prompt=["x", "y"])
    job = write_job(tmp_path / "j.toml", job_text(inp, tmp_path / "out", tiny_model))
    line = one_error_line(invoke("run", job))
    assert "'id'" in line and "key, prompt" in line


def test_duplicate_ids_are_refused_naming_the_id_and_rows(tmp_path, tiny_model):
    inp = write_parquet(tmp_path / "in.parquet", id=["a", "b", "c", "b"], prompt=PROMPTS)
    job = write_job(tmp_path / "j.toml", job_text(inp, tmp_path / "out", tiny_model))
    line = one_error_line(invoke("run", job))
    assert "duplicate ids" in line and "'b'" in line and "rows 1 and 3" in line
    assert not (tmp_path / "out").exists()


def test_null_empty_and_overlong_prompts_become_error_rows_and_exit_1(tmp_path, tiny_model):
    prompts = ["the cat", None, "", "x" * 2100, "a dog is"]  # the tiny model's context is 2048
    inp = write_parquet(tmp_path / "in.parquet", id=list(range(5)), prompt=prompts)
    out = tmp_path / "out"
    job = write_job(tmp_path / "j.toml", job_text(inp, out, tiny_model))
    r = invoke("run", job)
    assert r.exit_code == 1, r.output
    assert "3 row errors" in r.stderr and "Traceback" not in r.output
    rows = {row["id"]: row for row in parts_rows(out)}
    assert sorted(rows) == [0, 1, 2, 3, 4]
    assert rows[1]["error"] == "prompt is null" and rows[2]["error"] == "prompt is empty"
    assert "context" in rows[3]["error"]
    for i in (1, 2, 3):
        assert rows[i]["finish_reason"] == "error" and rows[i]["completion"] is None
    for i in (0, 4):
        assert rows[i]["error"] is None and rows[i]["completion_tokens"] > 0


def test_bad_chat_messages_become_error_rows(tmp_path, tiny_model):
    messages = [[{"role": "user", "content": "hi"}], [], None]
    inp = write_parquet(tmp_path / "in.parquet", id=["a", "b", "c"], messages=messages)
    out = tmp_path / "out"
    job = write_job(tmp_path / "j.toml", job_text(inp, out, tiny_model, prompt='messages = "messages"'))
    r = invoke("run", job)
    assert r.exit_code == 1
    rows = {row["id"]: row for row in parts_rows(out)}
    assert rows["a"]["error"] is None and rows["a"]["completion_tokens"] > 0
    assert "non-empty list" in rows["b"]["error"] and rows["c"]["error"] == "messages is null"


def test_garbage_parquet_file_is_named(tmp_path, tiny_model):
    bad = tmp_path / "in.parquet"
    bad.write_bytes(b"this is not parquet at all")
    job = write_job(tmp_path / "j.toml", job_text(bad, tmp_path / "out", tiny_model))
    line = one_error_line(invoke("run", job))
    assert str(bad) in line and "corrupt" in line


def test_truncated_parquet_file_in_a_directory_is_named(tmp_path, tiny_model, good_input):
    d = tmp_path / "data"
    d.mkdir()
    (d / "a.parquet").write_bytes(good_input.read_bytes())
    data = good_input.read_bytes()
    (d / "b.parquet").write_bytes(data[: len(data) // 2])
    job = write_job(tmp_path / "j.toml", job_text(d, tmp_path / "out", tiny_model))
    line = one_error_line(invoke("run", job))
    assert str(d / "b.parquet") in line


def test_corrupt_data_page_found_mid_run_is_named(tmp_path, tiny_model):
    # A valid footer but garbage inside the second row group's prompt pages:
    # found only while streaming, after the model is loaded.
    import pyarrow as pa

    ids = [f"r{i}" for i in range(8)]
    prompts = [f"prompt number {i} " * 3 for i in range(8)]
    path = tmp_path / "in.parquet"
    pq.write_table(
        pa.table({"id": ids, "prompt": prompts}), path, row_group_size=4, compression="none", use_dictionary=False
    )
    meta = pq.read_metadata(path)
    col = meta.row_group(1).column(1)
    data = bytearray(path.read_bytes())
    start = col.data_page_offset
    data[start : start + col.total_compressed_size] = b"\xff" * col.total_compressed_size
    path.write_bytes(bytes(data))
    out = tmp_path / "out"
    job = write_job(
        tmp_path / "j.toml",
        job_text(path, out, tiny_model, extra="flush_rows = 1\n") + "[batch]\nread_rows = 4\nwindow = 1\n",
    )
    line = one_error_line(invoke("run", job, "--quiet"))
    assert str(path) in line and "corrupt" in line and line.isprintable()


def test_output_under_a_file_is_refused(tmp_path, tiny_model, good_input):
    blocker = tmp_path / "blocker"
    blocker.write_text("a file, not a directory")
    job = write_job(tmp_path / "j.toml", job_text(good_input, blocker / "out", tiny_model))
    line = one_error_line(invoke("run", job))
    assert "blocker" in line and "not a directory" in line


def test_unwritable_output_directory_is_refused(tmp_path, tiny_model, good_input):
    # /proc refuses new entries even to root, where chmod would not.
    job = write_job(tmp_path / "j.toml", job_text(good_input, "/proc/mtplx-test-out", tiny_model))
    line = one_error_line(invoke("run", job))
    assert "/proc/mtplx-test-out" in line


def test_unknown_spec_key_is_refused(tmp_path, tiny_model, good_input):
    job = write_job(tmp_path / "j.toml", job_text(good_input, tmp_path / "out", tiny_model, extra="flush_every = 3\n"))
    line = one_error_line(invoke("run", job))
    assert "flush_every" in line and "[output]" in line


def test_missing_model_path_is_named(tmp_path, good_input):
    job = write_job(tmp_path / "j.toml", job_text(good_input, tmp_path / "out", tmp_path / "no-model"))
    line = one_error_line(invoke("run", job))
    assert "model path does not exist" in line and "no-model" in line


def test_missing_default_model_is_one_line(tmp_path, good_input):
    from mtplx.assets import default_model_path

    try:
        default_model_path()
        pytest.skip("the built-in default model is installed")
    except FileNotFoundError:
        pass
    job = write_job(tmp_path / "j.toml", job_text(good_input, tmp_path / "out", "default"))
    line = one_error_line(invoke("run", job))
    assert "default model" in line


def test_missing_job_file_is_named(tmp_path):
    line = one_error_line(invoke("run", tmp_path / "nope.toml"))
    assert "nope.toml" in line


def test_changed_spec_on_an_existing_output_is_refused_until_overwrite(tmp_path, tiny_model, good_input):
    out = tmp_path / "out"
    job = write_job(tmp_path / "j.toml", job_text(good_input, out, tiny_model))
    assert invoke("run", job).exit_code == 0
    changed = write_job(
        tmp_path / "j2.toml", job_text(good_input, out, tiny_model, extra="") + "[sampling]\ntemperature = 0.7\n"
    )
    line = one_error_line(invoke("run", changed))
    assert "different job" in line and "[sampling]" in line and "--overwrite" in line
    r = invoke("run", changed, "--overwrite")
    assert r.exit_code == 0, r.output
    assert len(parts_rows(out)) == 4


def test_changed_model_on_an_existing_output_is_refused(tmp_path, tiny_model, good_input):
    from mtplx.testing import tiny_checkpoint

    other = tiny_checkpoint("qwen3_5", tmp_path / "other", seed=1, vocab_size=64)
    out = tmp_path / "out"
    assert invoke("run", write_job(tmp_path / "a.toml", job_text(good_input, out, tiny_model))).exit_code == 0
    line = one_error_line(invoke("run", write_job(tmp_path / "b.toml", job_text(good_input, out, other))))
    assert "the model changed" in line


def test_bad_job_in_a_fresh_process_prints_one_line_and_no_traceback(tmp_path, tiny_model):
    inp = write_parquet(tmp_path / "in.parquet", id=["a"], text=["x"])
    r = run_cli("generate", "--input", inp, "--output", tmp_path / "out", "--model", tiny_model, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [
        f"mtplx: error: input {inp} has no column 'prompt' ([prompt] column); columns: id, text"
    ]


# ------------------------------------------------------- invalid UTF-8 text


def bad_utf8(*values):
    """A string column holding bytes as given: Parquet does not check UTF-8."""
    import pyarrow as pa

    return pa.array([v if v is None else v.encode() if isinstance(v, str) else v for v in values], pa.binary()).view(
        pa.string()
    )


def test_invalid_utf8_prompt_is_a_row_error_and_its_batch_goes_on(tmp_path, tiny_model):
    prompt = bad_utf8("the cat", b"def f(\xff\xfe):", "a dog is")
    note = bad_utf8("n0", "n1", b"\xc3(")
    inp = write_parquet(tmp_path / "in.parquet", id=["a", "b", "c"], prompt=prompt, note=note)
    out = tmp_path / "out"
    job = write_job(
        tmp_path / "j.toml", job_text(inp, out, tiny_model, id_line='id_column = "id"\nkeep_columns = ["note"]')
    )
    r = invoke("run", job)
    assert r.exit_code == 1, r.output
    assert "2 row errors" in r.stderr and "Traceback" not in r.output
    rows = {row["id"]: row for row in parts_rows(out)}
    assert rows["a"]["error"] is None and rows["a"]["completion_tokens"] > 0 and rows["a"]["note"] == "n0"
    assert rows["b"]["error"] == "prompt is not valid UTF-8" and rows["b"]["prompt"] is None
    assert rows["c"]["error"] == "column 'note' is not valid UTF-8" and rows["c"]["note"] is None
    assert rows["c"]["prompt"] == "a dog is"


def test_dry_run_counts_an_invalid_utf8_prompt_as_a_row_error(tmp_path, tiny_model):
    inp = write_parquet(tmp_path / "in.parquet", id=["a", "b"], prompt=bad_utf8("the cat", b"\xff\xfe"))
    job = write_job(tmp_path / "j.toml", job_text(inp, tmp_path / "out", tiny_model))
    r = invoke("run", job, "--dry-run")
    assert r.exit_code == 0, r.output
    assert "row errors seen already: 1" in r.stdout and "1 x prompt is not valid UTF-8" in r.stdout
    assert "prompts to run: 1" in r.stdout


def test_invalid_utf8_id_is_one_line_naming_the_file_column_and_row(tmp_path, tiny_model):
    d = tmp_path / "data"
    write_parquet(d / "a.parquet", id=["a", "b"], prompt=["x", "y"])
    write_parquet(d / "b.parquet", id=bad_utf8("c", "d", b"\xff"), prompt=["x", "y", "z"])
    job = write_job(tmp_path / "j.toml", job_text(d, tmp_path / "out", tiny_model))
    line = one_error_line(invoke("run", job))
    assert str(d / "b.parquet") in line and "'id'" in line and "not valid UTF-8" in line and "row 2" in line


# ----------------------------------------- the output directory inside the input


def test_input_directory_scan_leaves_out_the_output_directory_inside_it(tmp_path):
    from pipeline.inputs import open_input
    from pipeline.spec import InputSpec

    d = tmp_path / "data"
    write_parquet(d / "in.parquet", id=["a", "b"], prompt=["x", "y"])
    before = open_input(InputSpec(path=str(d)), exclude=d / "out")
    write_parquet(d / "out" / "part-00000.parquet", id=["a"], completion=["z"])  # a first run's output
    after = open_input(InputSpec(path=str(d)), exclude=d / "out")
    assert after.files == [d / "in.parquet"] and after.num_rows == 2
    assert after.fingerprint == before.fingerprint  # so the rerun resumes
    assert len(open_input(InputSpec(path=str(d))).files) == 2  # no exclude: every file, as before
    glob_input = open_input(InputSpec(path=str(d / "**" / "*.parquet")), exclude=d / "out")
    assert glob_input.files == [d / "in.parquet"]


@pytest.mark.parametrize("where", ["same", "parent"])
def test_output_directory_that_is_or_holds_the_input_is_refused(tmp_path, where):
    from pipeline.errors import JobError
    from pipeline.inputs import open_input
    from pipeline.spec import InputSpec

    d = tmp_path / "data"
    write_parquet(d / "in.parquet", id=["a"], prompt=["x"])
    out = d if where == "same" else tmp_path
    with pytest.raises(JobError) as e:
        open_input(InputSpec(path=str(d)), exclude=out)
    assert len(str(e.value).splitlines()) == 1
    assert f"output directory {out} " in str(e.value) and "outside" in str(e.value)
    # One input file cannot pick up the parts, wherever the output directory lies.
    assert open_input(InputSpec(path=str(d / "in.parquet")), exclude=out).num_rows == 1


# ------------------------------------------------- dictionary-encoded ids


def test_dictionary_encoded_ids_key_rows_like_plain_ones(tmp_path, tiny_model):
    import numpy as np
    import pyarrow as pa

    from pipeline.ids import id_hashes

    for plain in (pa.array(["r0", "r1", "r0"]), pa.array([7, -3, 7], pa.int64())):
        assert np.array_equal(id_hashes(plain.dictionary_encode()), id_hashes(plain))
    # Two files whose dictionaries have different index widths, as pandas
    # `category` columns get from their number of categories.
    d = tmp_path / "data"
    ids = pa.array(["r0", "r1", "r2", "r3"]).dictionary_encode()
    wide = pa.DictionaryArray.from_arrays(pa.array([0, 1], pa.int16()), pa.array(["r4", "r5"]))
    write_parquet(d / "a.parquet", id=ids, prompt=PROMPTS)
    write_parquet(d / "b.parquet", id=wide, prompt=PROMPTS[:2])
    out = tmp_path / "out"
    job = write_job(tmp_path / "j.toml", job_text(d, out, tiny_model))
    r = invoke("run", job)
    assert r.exit_code == 0, r.output
    table = pq.read_table(sorted(out.glob("part-*.parquet")))
    assert table.schema.field("id").type == pa.string()  # plain values, whatever the input's encoding
    assert sorted(table.column("id").to_pylist()) == [f"r{i}" for i in range(6)]
    r = invoke("run", job, "--dry-run")  # the output's plain ids match the dictionary input's keys
    assert r.exit_code == 0 and "6 already in the output" in r.stdout and "prompts to run: 0" in r.stdout


# ------------------------------------------------------------------ --help


def test_every_generate_and_bench_option_has_help():
    import click

    from pipeline.cli import cli

    for name in ("generate", "bench"):
        command = cli.commands[name]
        bare = [p.opts[-1] for p in command.params if isinstance(p, click.Option) and not p.help]
        assert bare == [], f"mtplx {name}: options without help: {bare}"


def test_a_template_format_a_rows_value_does_not_take_is_that_rows_error(tmp_path, tiny_model):
    inp = write_parquet(tmp_path / "in.parquet", id=["a", "b"], n=[7, None], word=["x", "y"])
    out = tmp_path / "out"
    job = write_job(tmp_path / "j.toml", job_text(inp, out, tiny_model, prompt='template = "{word} {n:d}"'))
    result = invoke("run", job)
    assert result.exit_code == 1, result.output
    rows = {r["id"]: r for r in parts_rows(out)}
    assert rows["a"]["error"] is None and rows["a"]["finish_reason"] in ("stop", "length")
    assert "null" in rows["b"]["error"]
    job = write_job(
        tmp_path / "j2.toml", job_text(inp, tmp_path / "out2", tiny_model, prompt='template = "{n} {word:d}"')
    )
    result = invoke("run", job)
    assert result.exit_code == 1, result.output
    rows = {r["id"]: r for r in parts_rows(tmp_path / "out2")}
    assert rows["a"]["error"].startswith("cannot render the template: ValueError"), rows["a"]
    assert "null" in rows["b"]["error"]


def test_a_top_k_past_int32_keeps_every_token_instead_of_crashing(tmp_path, tiny_model, good_input):
    for k, out in ((2**31, "big"), (0, "off")):
        result = invoke(
            "generate",
            "--input",
            good_input,
            "--output",
            tmp_path / out,
            "--model",
            tiny_model,
            "--max-tokens",
            4,
            "--temperature",
            1.0,
            "--top-k",
            k,
            "--seed",
            3,
        )
        assert result.exit_code == 0, result.output
    assert [r["completion_tokens"] for r in parts_rows(tmp_path / "big")] == [
        r["completion_tokens"] for r in parts_rows(tmp_path / "off")
    ]


def test_an_empty_id_column_option_keys_rows_by_index_past_an_unusable_id_column(tmp_path, tiny_model):
    inp = write_parquet(tmp_path / "in.parquet", id=[1.5, 1.5, 2.0, 3.0], prompt=PROMPTS)
    line = one_error_line(
        invoke("generate", "--input", inp, "--output", tmp_path / "o1", "--model", tiny_model, "--max-tokens", 4)
    )
    assert "must hold integers or strings" in line and "--id-column '' keys the rows by row index" in line
    result = invoke(
        "generate",
        "--input",
        inp,
        "--output",
        tmp_path / "o2",
        "--model",
        tiny_model,
        "--max-tokens",
        4,
        "--id-column",
        "",
    )
    assert result.exit_code == 0, result.output
    assert len(parts_rows(tmp_path / "o2")) == 4


def test_an_empty_input_file_whose_prompt_column_is_null_typed_joins_the_others(tmp_path, tiny_model):
    import pyarrow as pa

    d = tmp_path / "in"
    write_parquet(d / "a.parquet", id=["a", "b"], prompt=PROMPTS[:2])
    pq.write_table(pa.table({"id": pa.array([], pa.string()), "prompt": pa.array([], pa.null())}), d / "b.parquet")
    write_parquet(d / "c.parquet", id=["c"], prompt=pa.array([None], pa.null()))  # all null: a row error
    out = tmp_path / "out"
    result = invoke("run", write_job(tmp_path / "j.toml", job_text(d, out, tiny_model)))
    assert result.exit_code == 1, result.output
    rows = {r["id"]: r for r in parts_rows(out)}
    assert sorted(rows) == ["a", "b", "c"]
    assert rows["a"]["error"] is None and "null" in rows["c"]["error"]


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["generate", "--input", "x", "--output", "y", "--batch-size", "0"], "'--batch-size'"),
        (["generate", "--output", "y"], "Missing option '--input'"),
        (["generat"], "No such command 'generat'"),
        (["--bogus"], "No such option '--bogus'"),
    ],
)
def test_a_bad_command_line_is_one_line_naming_the_option_and_exit_2(args, fragment):
    line = one_error_line(invoke(*args))
    assert fragment in line and "--help" in line


def test_ctrl_c_before_a_job_installs_its_handler_is_one_line_and_exit_130(tmp_path, monkeypatch):
    import pipeline.summary

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(pipeline.summary, "load_or_compute", interrupted)
    result = invoke("inspect", tmp_path)
    assert result.exit_code == 130 and "mtplx: interrupted" in result.stderr, (result.exit_code, result.output)
