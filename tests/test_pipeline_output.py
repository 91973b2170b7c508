"""Output rows, summary.json and `mtplx inspect`, on the real runtime with a
tiny checkpoint; prompt sources, sampling, evaluation, dry runs."""

import json
import shutil

import pyarrow.parquet as pq
import pytest
from conftest import invoke, write_job, write_parquet

RESULT_COLUMNS = [
    "completion",
    "completion_tokens",
    "prompt_tokens",
    "finish_reason",
    "error",
    "drafted_by_depth",
    "accepted_by_depth",
    "acceptance_rate",
    "mean_accepted_length",
    "decode_steps",
    "shared_prefix_tokens",
]
SUMMARY_FIELDS = [
    "rows",
    "errors",
    "prompt_tokens",
    "completion_tokens",
    "wall_seconds",
    "prefill_tokens_per_second",
    "prefill_tokens",
    "shared_prefix_tokens",
    "decode_tokens_per_second",
    "acceptance_by_depth",
    "mean_accepted_length",
    "acceptance_rate",
    "peak_memory",
    "spec",
    "versions",
    "spec_hash",
    "model",
    "finish_reasons",
    "input_rows",
    "parts",
]
PROMPTS = ["the cat sat", "a dog ran", "the sun is", "hello there", "the cat sat", "one two"]


def read_parts(out):
    return pq.read_table(sorted(out.glob("part-*.parquet")))


def make_job(tmp_path, model, body, name="j"):
    inp = write_parquet(
        tmp_path / "in.parquet",
        id=[f"r{i}" for i in range(len(PROMPTS))],
        prompt=PROMPTS,
        reference=["the", "dog", "sun", "xyz", "the", "two"],
        topic=["a", "b", "c", "d", "e", "f"],
    )
    out = tmp_path / f"out-{name}"
    text = f'[model]\npath = "{model}"\n[input]\npath = "{inp}"\nid_column = "id"\n[output]\npath = "{out}"\n' + body
    return write_job(tmp_path / f"{name}.toml", text), out


@pytest.fixture(scope="module")
def finished(tmp_path_factory, tiny_model):
    """One greedy job over PROMPTS, depth 2, with evaluation and logprobs."""
    tmp = tmp_path_factory.mktemp("finished")
    job, out = make_job(
        tmp,
        tiny_model,
        '[prompt]\ncolumn = "prompt"\n[generation]\nmax_tokens = 6\n'
        '[evaluation]\nreference_column = "reference"\nscorer = "contains"\n',
    )
    r = invoke("run", job, "--logprobs")
    assert r.exit_code == 0, r.output
    return out


def test_output_schema_is_exactly_the_documented_columns(finished):
    t = read_parts(finished)
    assert t.column_names == ["id", "prompt", "reference"] + RESULT_COLUMNS + ["logprobs", "score"]
    assert str(t.schema.field("drafted_by_depth").type) == "list<element: int32>"
    assert t.num_rows == len(PROMPTS)
    assert sorted(t.column("id").to_pylist()) == sorted(f"r{i}" for i in range(len(PROMPTS)))


def test_rows_hold_consistent_metrics(finished):
    for row in read_parts(finished).to_pylist():
        assert row["error"] is None and row["finish_reason"] in ("stop", "length")
        assert row["completion_tokens"] <= 6 and len(row["logprobs"]) == row["completion_tokens"]
        assert len(row["drafted_by_depth"]) == 2 == len(row["accepted_by_depth"])
        drafted, accepted = sum(row["drafted_by_depth"]), sum(row["accepted_by_depth"])
        if drafted:
            assert row["acceptance_rate"] == pytest.approx(accepted / drafted)
        assert row["score"] == float(row["reference"] in row["completion"].strip())


def test_greedy_rows_with_the_same_prompt_get_the_same_completion(finished):
    rows = {r["id"]: r for r in read_parts(finished).to_pylist()}
    assert rows["r0"]["completion"] == rows["r4"]["completion"]


def test_summary_json_has_every_field_and_matches_the_parts(finished):
    s = json.loads((finished / ".mtplx" / "summary.json").read_text())
    missing = [f for f in SUMMARY_FIELDS if f not in s]
    assert not missing, missing
    t = read_parts(finished).to_pylist()
    assert s["rows"] == len(t) == s["input_rows"] and s["errors"] == 0 and s["complete"] is True
    assert s["prompt_tokens"] == sum(r["prompt_tokens"] for r in t)
    assert s["completion_tokens"] == sum(r["completion_tokens"] for r in t)
    for d in (0, 1):
        depth = s["acceptance_by_depth"][d]
        assert depth["depth"] == d + 1
        assert depth["drafted"] == sum(r["drafted_by_depth"][d] for r in t)
        assert depth["accepted"] == sum(r["accepted_by_depth"][d] for r in t)
    assert s["accuracy"] == pytest.approx(sum(r["score"] for r in t) / len(t))
    assert s["spec"]["generation"]["logprobs"] is True
    assert s["peak_memory"]["rss_bytes"] > 0 and "mlx" in s["versions"]


def test_inspect_prints_the_summary_and_the_acceptance_table(finished):
    s = json.loads((finished / ".mtplx" / "summary.json").read_text())
    r = invoke("inspect", finished)
    assert r.exit_code == 0, r.output
    assert f"{s['rows']} rows in {s['parts']} parts" in r.stdout and "complete" in r.stdout
    table = [ln.split() for ln in r.stdout.splitlines() if ln.strip()[:1].isdigit()]
    assert [int(x[0]) for x in table] == [1, 2]
    assert [int(x[1]) for x in table] == [d["drafted"] for d in s["acceptance_by_depth"]]
    assert json.loads(invoke("inspect", finished, "--json").stdout)["rows"] == s["rows"]


def test_inspect_of_an_unfinished_job_totals_the_parts(finished, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(finished, copy)
    (copy / ".mtplx" / "summary.json").unlink()
    r = invoke("inspect", copy)
    assert r.exit_code == 0 and "incomplete" in r.stdout and f"{len(PROMPTS)} rows" in r.stdout


def test_inspect_of_a_non_output_directory_is_a_bad_job(tmp_path):
    r = invoke("inspect", tmp_path)
    assert r.exit_code == 2 and "holds no mtplx output" in r.stderr


def test_n_samples_templates_and_seeds(tmp_path, tiny_model):
    body = (
        '[prompt]\ntemplate = ["Say {topic}", "About {topic}:"]\n[sampling]\ntemperature = 1.0\nseed = 7\n'
        "[generation]\nn = 3\nmax_tokens = 5\n"
    )
    job, out = make_job(tmp_path, tiny_model, body)
    r = invoke("run", job)
    assert r.exit_code == 0, r.output
    t = read_parts(out)
    assert t.column_names[:5] == ["id", "template_index", "sample_index", "topic", "rendered_prompt"]
    keys = sorted(
        zip(t.column("id").to_pylist(), t.column("template_index").to_pylist(), t.column("sample_index").to_pylist())
    )
    assert keys == sorted((f"r{i}", tt, s) for i in range(len(PROMPTS)) for tt in (0, 1) for s in range(3))
    rows = {(r["id"], r["template_index"], r["sample_index"]): r for r in t.to_pylist()}
    assert rows[("r1", 1, 0)]["rendered_prompt"] == "About b:"
    # samples of one prompt differ (keyed by sample index), and a rerun with
    # another seed changes them
    assert len({rows[("r0", 0, s)]["completion"] for s in range(3)}) > 1
    job2, out2 = make_job(tmp_path, tiny_model, body.replace("seed = 7", "seed = 8"), name="k")
    assert invoke("run", job2).exit_code == 0
    other = {(r["id"], r["template_index"], r["sample_index"]): r["completion"] for r in read_parts(out2).to_pylist()}
    assert sum(other[k] != rows[k]["completion"] for k in rows) > len(rows) // 2


def test_chat_messages_use_the_tokenizer_chat_template(tmp_path, tiny_model):
    inp = write_parquet(
        tmp_path / "in.parquet",
        messages=[[{"role": "user", "content": "hi"}], [{"role": "user", "content": "the cat"}]],
    )
    out = tmp_path / "out"
    job = write_job(
        tmp_path / "j.toml",
        f'[model]\npath = "{tiny_model}"\n[input]\npath = "{inp}"\n'
        f'[prompt]\nmessages = "messages"\n[generation]\nmax_tokens = 3\n[output]\npath = "{out}"\n',
    )
    assert invoke("run", job).exit_code == 0
    rows = sorted(read_parts(out).to_pylist(), key=lambda r: r["row_index"])
    # "user: hi\nassistant: " is 20 characters of the char-level tokenizer
    assert [r["row_index"] for r in rows] == [0, 1] and rows[0]["prompt_tokens"] == 20


@pytest.mark.parametrize(
    "scorer, reference, completion, expected",
    [
        ("exact", "abc", " abc\n", 1.0),
        ("exact", "abc", "abcd", 0.0),
        ("contains", "bc", "abcd", 1.0),
        ("contains", "x", "abcd", 0.0),
        ("regex", r"^a.c", "abcd", 1.0),
        ("regex", r"\d+", "abcd", 0.0),
        ("exact", None, "abc", None),
        ("exact", 42, "42", 1.0),
        # A reference with no text is no answer: "" is in every completion and matches every regex.
        ("contains", "", "abcd", None),
        ("contains", "   ", "abcd", None),
        ("regex", "", "abcd", None),
        ("exact", "", "", None),
    ],
)
def test_scorers(scorer, reference, completion, expected):
    from pipeline.scoring import make_scorer
    from pipeline.spec import EvaluationSpec

    assert make_scorer(EvaluationSpec("reference", scorer))(completion, reference) == expected


def test_an_invalid_regex_reference_is_a_scoring_error_that_names_the_pattern():
    from pipeline.scoring import ScoreError, make_scorer
    from pipeline.spec import EvaluationSpec

    with pytest.raises(ScoreError, match=r"reference 'a\(b' is not a valid regular expression"):
        make_scorer(EvaluationSpec("reference", "regex"))("abcd", "a(b")


def test_dry_run_reports_without_loading_weights_or_writing(tmp_path, tiny_model):
    broken = tmp_path / "model"
    shutil.copytree(tiny_model, broken)
    shard = sorted(broken.glob("*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:-64])  # loading the weights would fail
    prompts = ["the cat", None, "x" * 2100]
    inp = write_parquet(tmp_path / "in.parquet", id=["a", "b", "c"], prompt=prompts)
    out = tmp_path / "out"
    job = write_job(
        tmp_path / "j.toml",
        f'[model]\npath = "{broken}"\n[input]\npath = "{inp}"\nid_column = "id"\n'
        f'[prompt]\ncolumn = "prompt"\n[generation]\nmax_tokens = 8\n[output]\npath = "{out}"\n',
    )
    r = invoke("run", job, "--dry-run")
    assert r.exit_code == 0, r.output
    assert not out.exists()
    assert "3 rows" in r.stdout and "prompts to run: 2, prompt tokens 2107" in r.stdout
    assert "1 x prompt is null" in r.stdout and "over the context (2048 tokens, with max_tokens 8): 1" in r.stdout
    assert "columns: id, prompt, completion" in r.stdout
    r = invoke("run", job)
    assert r.exit_code == 2 and "cannot load model" in r.stderr


def test_generate_equals_the_same_job_run_from_a_spec(tmp_path, tiny_model):
    job, out = make_job(tmp_path, tiny_model, '[prompt]\ncolumn = "prompt"\n[generation]\nmax_tokens = 5\n')
    assert invoke("run", job).exit_code == 0
    out2 = tmp_path / "gen"
    r = invoke(
        "generate",
        "--input",
        tmp_path / "in.parquet",
        "--output",
        out2,
        "--model",
        tiny_model,
        "--max-tokens",
        5,
        "--batch-size",
        3,
        "--keep-column",
        "topic",
    )
    assert r.exit_code == 0, r.output
    a = {r["id"]: r["completion"] for r in read_parts(out).to_pylist()}
    b = read_parts(out2)
    assert b.column_names[:3] == ["id", "prompt", "topic"]
    assert {r["id"]: r["completion"] for r in b.to_pylist()} == a


def test_datasets_input_and_row_index_keys(tmp_path, tiny_model):
    datasets = pytest.importorskip("datasets")
    path = tmp_path / "ds"
    datasets.Dataset.from_dict({"prompt": ["the cat", "a dog", "the sun"]}).save_to_disk(str(path))
    out = tmp_path / "out"
    job = write_job(
        tmp_path / "j.toml",
        f'[model]\npath = "{tiny_model}"\n[input]\ndataset = "{path}"\n'
        f'[prompt]\ncolumn = "prompt"\n[generation]\nmax_tokens = 3\n[output]\npath = "{out}"\n',
    )
    r = invoke("run", job)
    assert r.exit_code == 0, r.output
    rows = sorted(read_parts(out).to_pylist(), key=lambda r: r["row_index"])
    assert [(r["row_index"], r["prompt"]) for r in rows] == [(0, "the cat"), (1, "a dog"), (2, "the sun")]


def test_a_directory_of_parquet_files_is_read_in_name_order(tmp_path, tiny_model):
    d = tmp_path / "data"
    write_parquet(d / "b.parquet", prompt=["from b"])
    write_parquet(d / "a.parquet", prompt=["from a", "also a"])
    out = tmp_path / "out"
    r = invoke("generate", "--input", d, "--output", out, "--model", tiny_model, "--max-tokens", 2)
    assert r.exit_code == 0, r.output
    rows = sorted(read_parts(out).to_pylist(), key=lambda r: r["row_index"])
    assert [r["prompt"] for r in rows] == ["from a", "also a", "from b"]


def test_max_memory_too_small_for_the_weights_is_a_bad_job(tmp_path, tiny_model):
    job, out = make_job(tmp_path, tiny_model, '[prompt]\ncolumn = "prompt"\n')
    r = invoke("run", job, "--max-memory", "100KB")
    assert r.exit_code == 2 and "--max-memory" in r.stderr and "too small" in r.stderr


def test_max_memory_sizes_the_runtime(tmp_path, tiny_model):
    job, out = make_job(tmp_path, tiny_model, '[prompt]\ncolumn = "prompt"\n[generation]\nmax_tokens = 3\n')
    r = invoke("run", job, "--max-memory", "1GB")
    assert r.exit_code == 0, r.output
    rt = json.loads((out / ".mtplx" / "summary.json").read_text())["runtime"]
    assert 1 <= rt["max_batch"] <= 16 and rt["estimated_memory_bytes"] <= 10**9


def test_a_job_of_fewer_rows_than_slots_decodes_in_as_many_slots_as_it_has_samples(tmp_path, tiny_model):
    inp, out = tmp_path / "in.parquet", tmp_path / "out"
    write_parquet(inp, prompt=["the cat", "a dog", "one"])
    r = invoke(
        "generate", "--input", inp, "--output", out, "--model", tiny_model, "--max-tokens", 2, "--batch-size", 16
    )
    assert r.exit_code == 0, r.output
    assert json.loads((out / ".mtplx" / "summary.json").read_text())["runtime"]["max_batch"] == 3
    assert read_parts(out).num_rows == 3


def test_inspect_of_a_foreign_parquet_file_named_like_a_part_is_a_bad_job(tmp_path):
    d = tmp_path / "foreign"
    write_parquet(d / "part-00000.parquet", id=["a"], prompt=["the cat"])
    r = invoke("inspect", d)
    assert r.exit_code == 2 and "not an MTPLX output part" in r.stderr and "part-00000.parquet" in r.stderr


def test_a_reference_column_of_bytes_or_floats_is_a_bad_job_not_a_silent_zero(tmp_path, tiny_model):
    import pyarrow as pa

    for name, values in (("binary", pa.array([b"ab", b"cd"])), ("float", pa.array([3.0, 4.0]))):
        inp = write_parquet(tmp_path / f"{name}.parquet", prompt=["a b", "c d"], reference=values)
        job = write_job(
            tmp_path / f"{name}.toml",
            f'[model]\npath = "{tiny_model}"\n[input]\npath = "{inp}"\n[prompt]\ncolumn = "prompt"\n'
            f'[evaluation]\nreference_column = "reference"\n[generation]\nmax_tokens = 2\n'
            f'[output]\npath = "{tmp_path / name}"\n',
        )
        result = invoke("run", job)
        assert result.exit_code == 2 and "reference column 'reference' must hold strings or integers" in result.stderr
