"""Job spec validation: every key checked up front, unknown keys rejected."""

import pytest

from pipeline.errors import JobError
from pipeline.spec import load_spec, parse_memory, spec_from_dict

BASE = {"input": {"path": "in.parquet"}, "prompt": {"column": "prompt"}, "output": {"path": "out"}}


def doc(**sections):
    d = {k: dict(v) for k, v in BASE.items()}
    for k, v in sections.items():
        d[k] = {**d.get(k, {}), **v} if isinstance(v, dict) else v
    return d


def error_of(d) -> str:
    with pytest.raises(JobError) as e:
        spec_from_dict(d)
    return str(e.value)


def test_minimal_spec_gets_documented_defaults():
    s = spec_from_dict(doc())
    assert s.model.path is None and s.model.depth == 2 and s.model.acceptance == "residual"
    assert s.generation.n == 1 and s.generation.max_tokens == 256
    assert s.sampling.temperature == 0.0 and s.sampling.seed == 0
    assert s.prompt.mode == "column" and s.evaluation is None


def test_unknown_key_in_a_section_is_an_error_naming_it():
    msg = error_of(doc(sampling={"temprature": 0.5}))
    assert "temprature" in msg and "[sampling]" in msg and "temperature" in msg


def test_unknown_top_level_section_is_an_error():
    msg = error_of(doc(samplng={"temperature": 0.5}))
    assert "samplng" in msg and "top level" in msg


@pytest.mark.parametrize(
    "section, key, value, fragment",
    [
        ("sampling", "temperature", -1, "temperature"),
        ("sampling", "top_p", 0, "top_p"),
        ("sampling", "top_k", 1.5, "top_k"),
        ("sampling", "seed", "x", "seed"),
        ("generation", "n", 0, "n"),
        ("generation", "max_tokens", True, "max_tokens"),
        ("model", "depth", "deep", "depth"),
        ("model", "depth", 15, "depth"),  # past MAX_DEPTH: a verify would span a prompt pass's width
        ("model", "acceptance", "greedy", "acceptance"),
        ("evaluation", "scorer", "fuzzy", "scorer"),
        ("batch", "max_memory", "lots", "max_memory"),
    ],
)
def test_bad_values_are_named(section, key, value, fragment):
    d = doc(**{section: {key: value}})
    if section == "evaluation":
        d["evaluation"]["reference_column"] = "reference"
    assert fragment in error_of(d)


def test_prompt_needs_exactly_one_source():
    assert "exactly one of column, messages or template" in error_of(doc(prompt={"messages": "m"}))
    d = doc()
    d["prompt"] = {}
    assert "exactly one" in error_of(d)


def test_input_needs_exactly_one_of_path_or_dataset():
    assert "exactly one of path" in error_of(doc(input={"dataset": "x"}))


def test_output_path_is_required():
    d = doc()
    del d["output"]
    assert "[output] path" in error_of(d)


def test_template_fields_must_name_columns():
    d = doc()
    d["prompt"] = {"template": "Q: {0}"}
    assert "name a column" in error_of(d)
    d["prompt"] = {"template": "no fields at all"}
    assert "uses no column" in error_of(d)
    d["prompt"] = {"template": ["Q: {question}", "Answer {question} briefly"]}
    assert spec_from_dict(d).prompt.templates == ("Q: {question}", "Answer {question} briefly")


def test_depth_accepts_auto_and_default_model_keyword():
    s = spec_from_dict(doc(model={"depth": "auto", "path": "default"}))
    assert s.model.depth == "auto" and s.model.path is None


def test_memory_sizes_parse():
    assert parse_memory("x", "8GB") == 8 * 10**9
    assert parse_memory("x", "512 MiB") == 512 * 2**20
    assert parse_memory("x", 1000) == 1000
    with pytest.raises(JobError):
        parse_memory("x", "-1GB")


def test_relative_paths_resolve_against_the_spec_file(tmp_path):
    job = tmp_path / "jobs" / "j.toml"
    job.parent.mkdir()
    job.write_text(
        '[input]\npath = "data/p.parquet"\n[prompt]\ncolumn = "prompt"\n[output]\npath = "../out/j"\n'
        '[model]\npath = "models/m"\n'
    )
    s = load_spec(job)
    assert s.input.path == str(job.parent / "data/p.parquet")
    assert s.output.path == str(tmp_path / "out" / "j")
    assert s.model.path == str(job.parent / "models/m")
    assert s.name == "j"


def test_invalid_toml_names_the_file(tmp_path):
    job = tmp_path / "bad.toml"
    job.write_text("[input\npath = 1")
    with pytest.raises(JobError, match="bad.toml: invalid TOML"):
        load_spec(job)


def test_batch_and_output_settings_do_not_change_the_identity():
    a = spec_from_dict(doc(batch={"max_batch": 4}, output={"flush_rows": 3}))
    b = spec_from_dict(doc(batch={"max_batch": 32}, output={"path": "elsewhere"}))
    c = spec_from_dict(doc(sampling={"temperature": 0.5}))
    assert a.identity() == b.identity()
    assert a.identity() != c.identity()


def test_template_conversions_and_nested_format_fields_that_can_never_render_are_refused():
    d = doc()
    d["prompt"] = {"template": "Q: {question!z}"}
    assert "unknown conversion" in error_of(d)
    d["prompt"] = {"template": "Q: {question:{width}}"}
    assert "nests a field" in error_of(d)
    d["prompt"] = {"template": "Q: {question!r:>20}"}
    assert spec_from_dict(d).prompt.templates == ("Q: {question!r:>20}",)


def test_a_job_file_that_is_not_utf8_is_named(tmp_path):
    job = tmp_path / "latin1.toml"
    job.write_bytes('name = "caf\xe9"\n'.encode("latin-1"))
    with pytest.raises(JobError, match="latin1.toml is not UTF-8"):
        load_spec(job)


def test_a_relative_glob_resolves_under_a_spec_directory_whose_name_holds_glob_characters(tmp_path):
    import glob

    base = tmp_path / "jobs [old]*"
    (base / "data").mkdir(parents=True)
    for name in ("a.parquet", "b.parquet"):
        (base / "data" / name).write_bytes(b"")
    job = base / "j.toml"
    job.write_text('[input]\npath = "data/*.parquet"\n[prompt]\ncolumn = "prompt"\n[output]\npath = "out"\n')
    s = load_spec(job)
    assert sorted(glob.glob(s.input.path)) == [str(base / "data" / "a.parquet"), str(base / "data" / "b.parquet")]
    literal = base / "data[2024].parquet"  # a file name with brackets is no pattern when it exists
    literal.write_bytes(b"")
    job.write_text('[input]\npath = "data[2024].parquet"\n[prompt]\ncolumn = "prompt"\n[output]\npath = "out"\n')
    assert load_spec(job).input.path == str(literal)


def test_draft_vocab_is_checked_and_enters_the_identity_only_when_set():
    plain = spec_from_dict(doc())
    assert plain.model.draft_vocab == 0 and "draft_vocab" not in plain.identity()["model"]  # as before the setting
    reduced = spec_from_dict(doc(model={"draft_vocab": 32768}))
    assert reduced.model.draft_vocab == 32768 and reduced.identity() != plain.identity()  # it changes sampled rows
    for bad in (-1, 1.5, "all"):
        assert "draft_vocab" in error_of(doc(model={"draft_vocab": bad}))
