"""What `runtime.generate` accepts and how it says no: stop strings, argument
types, token-id prompts (bad ids end their own row only), the contract's
depth, and safetensors headers of the wrong shape."""

import json
import struct

import mlx.core as mx
import numpy as np
import pytest
from model_helpers import make_predictable

import mtplx
from mtplx import MTPContract, MTPLXRuntime
from mtplx.decode.requests import Request
from mtplx.models.adapter import CheckpointError
from mtplx.models.checkpoint import read_header
from mtplx.testing import tiny_checkpoint

VOCAB = 48
GOOD = [5, 6, 7]


@pytest.fixture(scope="module")
def rt(tmp_path_factory):
    path = tiny_checkpoint("qwen3_5", tmp_path_factory.mktemp("qwen3_5"), vocab_size=VOCAB)
    return MTPLXRuntime(make_predictable(mtplx.load(path)), MTPContract(depth=2), max_batch=4)


# -- stop strings ---------------------------------------------------------------------


def test_a_plain_string_stop_is_one_stop_string_not_its_characters(rt):
    assert Request(index=0, prompt=GOOD, stop="ab").stop == ("ab",)
    full = rt.generate([GOOD], max_tokens=8)[0].text
    stop = full[2:4]
    as_str = rt.generate([GOOD], max_tokens=8, stop=stop)[0]
    as_list = rt.generate([GOOD], max_tokens=8, stop=[stop])[0]
    assert as_str.finish_reason == "stop" and as_str.text == full[: full.index(stop)]
    assert (as_str.tokens, as_str.text) == (as_list.tokens, as_list.text)


@pytest.mark.parametrize("stop", [[""], "", ["x", ""]])
def test_an_empty_stop_string_is_rejected(rt, stop):
    with pytest.raises(ValueError, match="stop strings must not be empty"):
        rt.generate([GOOD], max_tokens=3, stop=stop)


# -- argument types -------------------------------------------------------------------


@pytest.mark.parametrize("max_tokens", [2.5, None, True, "3"])
def test_max_tokens_that_is_not_an_integer_is_a_clear_type_error(rt, max_tokens):
    with pytest.raises(TypeError, match="max_tokens must be an integer >= 1"):
        rt.generate([GOOD], max_tokens=max_tokens)


def test_max_tokens_as_a_numpy_integer_is_accepted(rt):
    out = rt.generate([GOOD], max_tokens=np.int64(3))[0]
    assert out.finish_reason in ("stop", "length") and 1 <= len(out.tokens) <= 3


def test_n_that_is_not_an_integer_is_a_clear_type_error(rt):
    with pytest.raises(TypeError, match="n must be an integer >= 1"):
        rt.generate([GOOD], max_tokens=3, n=2.5)


@pytest.mark.parametrize("prompts", ["abc", b"abc", GOOD, 5])
def test_prompts_that_are_not_a_list_of_prompts_are_a_clear_type_error(rt, prompts):
    # A lone string used to become one prompt per character, and one
    # prompt's ids failed deep inside.
    with pytest.raises(TypeError, match="prompts must be a list of strings or of token-id lists"):
        rt.generate(prompts, max_tokens=2)


@pytest.mark.parametrize("row_ids", [["a"], ["a", "b", "c"]])
def test_row_ids_of_the_wrong_length_are_a_clear_value_error(rt, row_ids):
    with pytest.raises(ValueError, match="row_ids must have one id per prompt: .* for 2 prompts"):
        rt.generate([GOOD, GOOD], max_tokens=2, row_ids=row_ids)


@pytest.mark.parametrize("kwargs", [dict(depth=True), dict(depth=False), dict(max_depth_auto=True)])
def test_contract_rejects_bools_as_depths(kwargs):
    with pytest.raises(ValueError, match="must be"):
        MTPContract(**kwargs)


# -- token-id prompts -----------------------------------------------------------------


@pytest.mark.parametrize(
    "bad",
    [[5, float("nan")], [5.9, 7.2], [True, 5], [5, "a"], np.array([5.5, 6.0]), [5, [6]], [float("inf")]],
    ids=["nan", "fractional", "bool", "str", "float-array", "nested", "inf"],
)
def test_a_prompt_with_non_integer_ids_is_that_rows_error_and_the_others_complete(rt, bad):
    want = rt.generate([GOOD], max_tokens=4)[0].tokens
    err, ok = rt.generate([bad, GOOD], max_tokens=4)
    assert err.finish_reason == "error" and "token ids must be integers" in err.error
    assert err.tokens == []
    assert ok.finish_reason != "error" and ok.tokens == want


@pytest.mark.parametrize(
    "ids",
    [[np.int64(5), 6, np.int32(7)], np.array(GOOD, dtype=np.int32), mx.array(GOOD), [5.0, 6.0, 7.0]],
    ids=["numpy-scalars", "numpy-array", "mlx-array", "integral-floats"],
)
def test_integral_token_ids_of_any_int_type_are_accepted(rt, ids):
    want = rt.generate([GOOD], max_tokens=4)[0].tokens
    assert rt.generate([ids], max_tokens=4)[0].tokens == want


# -- safetensors headers ----------------------------------------------------------------


def _drop_offsets(h):
    h[next(k for k in h if k != "__metadata__")].pop("data_offsets")
    return h


def _bad_offsets(h):
    h[next(k for k in h if k != "__metadata__")]["data_offsets"] = [8, 0]
    return h


HEADER_EDITS = {
    "entry-without-data_offsets": _drop_offsets,
    "header-is-a-list": lambda h: [1, 2],
    "metadata-renamed": lambda h: {("meta" if k == "__metadata__" else k): v for k, v in h.items()},
    "entry-is-a-number": lambda h: {**h, "x": 3},
    "offsets-reversed": _bad_offsets,
}


def _rewrite_header(file, edit):
    data = file.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.dumps(edit(json.loads(data[8 : 8 + n]))).encode()
    header += b" " * (-len(header) % 8)
    file.write_bytes(struct.pack("<Q", len(header)) + header + data[8 + n :])


@pytest.mark.parametrize("edit", HEADER_EDITS.values(), ids=HEADER_EDITS.keys())
def test_a_safetensors_header_of_the_wrong_shape_is_a_checkpoint_error_naming_the_file(tmp_path, edit):
    file = tmp_path / "model.safetensors"
    mx.save_safetensors(str(file), {"a": mx.zeros((2, 3)), "b": mx.ones((4,))}, metadata={"format": "pt"})
    assert set(read_header(file)) == {"a", "b"}
    _rewrite_header(file, edit)
    with pytest.raises(CheckpointError, match=f"corrupt safetensors file .*{file.name}"):
        read_header(file)


def test_mtplx_load_names_a_shard_whose_header_has_an_entry_without_offsets(tmp_path):
    path = tiny_checkpoint("qwen3_5", tmp_path / "ck", vocab_size=VOCAB)
    shard = sorted(path.glob("model-*.safetensors"))[0]
    _rewrite_header(shard, _drop_offsets)
    with pytest.raises(CheckpointError, match=f"corrupt safetensors file .*{shard.name}"):
        mtplx.load(path)


def test_a_str_prompt_with_a_lone_surrogate_is_that_rows_error_and_the_others_complete(rt):
    outs = rt.generate(["abc", "a\ud800b", "cab"], max_tokens=3)
    assert outs[1].finish_reason == "error" and "not valid Unicode" in outs[1].error
    assert outs[0].error is None and outs[2].error is None and len(outs[0].tokens) == 3


def test_stop_strings_prompts_and_depths_from_numpy_and_pyarrow_are_taken_as_before(rt):
    import pyarrow as pa

    plain = rt.generate([GOOD, [8, 9]], max_tokens=4, stop=["zz", "yy"])
    assert [o.tokens for o in rt.generate([GOOD, [8, 9]], max_tokens=4, stop=np.array(["zz", "yy"]))] == [
        o.tokens for o in plain
    ]
    ids = pa.table({"ids": [GOOD, [8, 9]]})["ids"]  # a ChunkedArray of list<int64>
    assert [o.tokens for o in rt.generate(ids, max_tokens=4)] == [
        o.tokens for o in rt.generate([GOOD, [8, 9]], max_tokens=4)
    ]
    assert MTPContract(depth=np.int64(2), max_depth_auto=np.int64(3)).max_depth_auto == 3


def test_a_str_prompt_that_starts_with_the_bos_text_gets_no_second_bos(tmp_path):
    from tokenizers import Tokenizer, processors

    from mtplx.models.tokenizer_files import write_char_tokenizer

    path = tiny_checkpoint("qwen3_5", tmp_path / "m", vocab_size=VOCAB)
    write_char_tokenizer(path, VOCAB - 1)  # ids 0..46; "<s>" becomes 47
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.add_special_tokens(["<s>"])
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    tok.save(str(path / "tokenizer.json"))
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "bos_token": "<s>", "add_bos_token": True}))
    model = mtplx.load(path)
    plain = model.tokenizer.encode("hello there")
    assert plain[0] == bos and plain[1] != bos  # the tokenizer adds its BOS
    rt = MTPLXRuntime(model, MTPContract(depth=0), max_batch=2)
    with_bos, without = rt.generate(["<s>hello there", "hello there"], max_tokens=6)
    assert with_bos.prompt_tokens == without.prompt_tokens == len(plain)  # one BOS either way, as mlx-lm encodes
    assert with_bos.tokens == without.tokens


@pytest.mark.parametrize("sampling", [[None], [{"temperature": 1.0}]])
def test_a_sampling_list_entry_that_is_not_sampling_params_is_a_clear_type_error(rt, sampling):
    with pytest.raises(TypeError, match="sampling must be a SamplingParams"):
        rt.generate([GOOD], sampling=sampling, max_tokens=2)


@pytest.mark.parametrize("seed, error", [(1.7, TypeError), ("5", TypeError), (True, TypeError), (2**64, ValueError)])
def test_a_seed_that_is_not_a_64_bit_integer_is_refused_not_truncated_into_another(rt, seed, error):
    with pytest.raises(error, match="seed"):
        rt.generate([GOOD], sampling=mtplx.SamplingParams(temperature=1.0), max_tokens=2, seed=seed)


def test_numpy_sampling_values_seeds_and_a_lone_stop_id_are_accepted(rt):
    sp = mtplx.SamplingParams(temperature=np.float32(0.5), top_p=np.float64(0.9), min_p=np.float32(0.0))
    a = rt.generate([GOOD], sampling=sp, max_tokens=4, seed=np.int64(3), stop_token_ids=np.int64(9))
    b = rt.generate(
        [GOOD], sampling=mtplx.SamplingParams(temperature=0.5, top_p=0.9), max_tokens=4, seed=3, stop_token_ids=[9]
    )
    assert a[0].tokens == b[0].tokens
    with pytest.raises(TypeError, match="stop_token_ids"):
        rt.generate([GOOD], max_tokens=2, stop_token_ids=["a"])


# -- warm-up --------------------------------------------------------------------------


def test_warm_up_changes_no_output_and_leaves_the_stats_of_a_fresh_runtime(tmp_path):
    path = tiny_checkpoint("qwen3_5", tmp_path / "m", vocab_size=VOCAB)
    model = make_predictable(mtplx.load(path))
    cold = MTPLXRuntime(model, MTPContract(depth=2), max_batch=4)
    warm = MTPLXRuntime(model, MTPContract(depth=2), max_batch=4)
    fresh = {k: v for k, v in warm.stats.items()}
    sampling = mtplx.SamplingParams(temperature=0.9, top_p=0.9)
    warm.warm_up(sampling, logprobs=True)
    assert warm.stats == fresh and not warm.launch_started
    prompts = [GOOD, [9, 3], [4] * 7]
    kwargs = dict(sampling=sampling, max_tokens=9, seed=5, logprobs=True)
    a, b = cold.generate(prompts, **kwargs), warm.generate(prompts, **kwargs)
    assert [(c.tokens, c.logprobs, c.finish_reason) for c in a] == [(c.tokens, c.logprobs, c.finish_reason) for c in b]
    untimed = lambda stats: {k: v for k, v in stats.items() if not k.endswith("_seconds")}
    assert untimed(cold.stats) == untimed(warm.stats) != untimed(fresh)


WARM_UP_THEN_GENERATE = """
import os, sys
from pathlib import Path
import mtplx
from mtplx import MTPContract, MTPLXRuntime
kernels = lambda: sum(1 for p in Path(os.environ["TMPDIR"]).rglob("*") if p.is_file())
rt = MTPLXRuntime(mtplx.load(sys.argv[1]), MTPContract(depth=2), max_batch=4)
sampling = mtplx.SamplingParams(temperature=0.9)
rt.warm_up(sampling)
built = kernels()
rt.eos = set()  # a row ending early shrinks the batch: other shapes, other kernels
rt.generate([[5, 6, 7]] * 4, sampling=sampling, max_tokens=12)
print(built, kernels())
"""


@pytest.mark.slow  # builds every kernel from nothing: about a minute here
def test_after_warm_up_a_batch_at_its_settings_builds_no_kernel(tmp_path):
    # On the CPU backend MLX builds a kernel by running the C++ compiler
    # through system(), which ignores SIGINT process-wide meanwhile; a job
    # warms up before it installs its handlers so that no Ctrl-C is lost.
    import subprocess
    import sys

    from conftest import cli_env

    path = tiny_checkpoint("qwen3_5", tmp_path / "m", vocab_size=VOCAB)
    cache = tmp_path / "kernels"
    cache.mkdir()
    env = {**cli_env(), "TMPDIR": str(cache)}
    r = subprocess.run(
        [sys.executable, "-c", WARM_UP_THEN_GENERATE, str(path)], env=env, capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, r.stderr
    built, after = map(int, r.stdout.split())
    assert built > 0 and after == built
