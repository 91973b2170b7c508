"""`mtplx` commands about models and speed: convert, inspect-model,
train-tiny, bench. The job commands live in `pipeline/cli.py`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from mtplx.bench.run import (
    BARE_COST_ROUNDS_BETWEEN,
    BARE_COST_ROUNDS_FIRST,
    QUICK,
)  # the make-bench settings: the command's defaults (no MLX import)


def _fail(message: str):
    click.echo(f"error: {message}", err=True)
    sys.exit(2)


@click.command("convert")
@click.argument("src", type=click.Path())
@click.argument("dst", type=click.Path())
@click.option("--q-bits", type=click.Choice(["4", "8"]), default=None, help="Quantise the weights to this many bits.")
@click.option("--q-group-size", type=int, default=64, show_default=True, help="Quantisation group size.")
@click.option(
    "--keep-head-precision", is_flag=True, help="Quantise the trunk only; keep the MTP head in full precision."
)
@click.option(
    "--dtype",
    type=click.Choice(["float32", "float16", "bfloat16"]),
    default=None,
    help="Cast unquantised weights (default: the checkpoint's torch_dtype, as mlx-lm does).",
)
@click.option("--overwrite", is_flag=True, help="Replace a non-empty DST.")
def convert_cmd(src, dst, q_bits, q_group_size, keep_head_precision, dtype, overwrite):
    """Convert a Hugging Face checkpoint SRC to MLX in DST, keeping its MTP head.

    The trunk goes through mlx-lm's own conversion; the MTP head (which
    mlx-lm drops) is written next to it as mtp.safetensors, quantised with the
    trunk unless --keep-head-precision. `mtplx.load(DST)` then loads both.
    """
    from mtplx import CheckpointError
    from mtplx.models.convert import convert, format_convert_report

    try:
        report = convert(
            src,
            dst,
            q_bits=int(q_bits) if q_bits else None,
            q_group_size=q_group_size,
            quantize_head=not keep_head_precision,
            dtype=dtype,
            overwrite=overwrite,
        )
    except (CheckpointError, FileExistsError, ValueError, FileNotFoundError) as e:
        _fail(str(e))
    click.echo(format_convert_report(report))


@click.command("inspect-model")
@click.argument("path", type=click.Path(), required=False)
@click.option("--json", "as_json", is_flag=True, help="Print the description as JSON.")
def inspect_model_cmd(path, as_json):
    """Describe a checkpoint: family, trunk and head parameter counts,
    dtype/quantisation, head depth, and whether the MTP head is complete.
    Without PATH, the built-in default model."""
    from mtplx import CheckpointError
    from mtplx.models.info import describe_model, format_model_description

    try:
        if path is None:
            from mtplx import default_model_path

            path = default_model_path()
        d = describe_model(path)
    except (CheckpointError, FileNotFoundError) as e:
        _fail(str(e))
    click.echo(json.dumps(d, indent=2, default=str) if as_json else format_model_description(d))


@click.command("train-tiny")
@click.argument("out", type=click.Path())
@click.option("--steps", type=int, default=None, help="Training steps (default: the shipped model's recipe).")
@click.option("--seed", type=int, default=0, show_default=True)
def train_tiny_cmd(out, steps, seed):
    """Train the small built-in default model (a Qwen3.5-family trunk with a
    trained MTP head) from this Python's standard library, and write it to
    OUT in the Hugging Face layout. Deterministic for a given seed."""
    from mtplx.training.tiny import DEFAULT_STEPS, train_tiny

    meta = train_tiny(out, steps=steps or DEFAULT_STEPS, seed=seed)
    click.echo(f"wrote {out} ({meta.get('wall_seconds', 0):.0f} s)")


def _csv(kind):
    def parse(ctx, param, value):
        if value is None:
            return None
        try:
            return tuple(kind(v) for v in value.split(",") if v.strip())
        except ValueError:
            raise click.BadParameter(f"expected a comma-separated list, got {value!r}") from None

    return parse


def _depth(v: str):
    return "auto" if v.strip() == "auto" else int(v)


def _listed(values) -> str:
    return ",".join(f"{v:g}" if isinstance(v, float) else str(v) for v in values)


@click.command("bench")
@click.option("--model", type=click.Path(), default=None, help="Checkpoint (default: the built-in model).")
@click.option(
    "--batch-sizes",
    callback=_csv(int),
    default=_listed(QUICK["batch_sizes"]),
    show_default=True,
    help="Comma-separated decode batch sizes to measure, each a separate series.",
)
@click.option(
    "--depths",
    callback=_csv(_depth),
    default=_listed(QUICK["depths"]),
    show_default=True,
    help="Comma-separated MTP depths to compare with the baseline: 0 decodes plainly, 'auto' "
    "picks from the cost model. Depth 0 always runs: speed-ups are measured over it.",
)
@click.option(
    "--temperatures",
    callback=_csv(float),
    default=_listed(QUICK["temperatures"]),
    show_default=True,
    help="Comma-separated sampling temperatures to measure at (0 = greedy).",
)
@click.option(
    "--max-tokens",
    type=int,
    default=QUICK["max_tokens"],
    show_default=True,
    help="New tokens per prompt at most, for both engines.",
)
@click.option(
    "--prompts",
    "num_prompts",
    callback=_csv(int),
    default=None,
    help="Prompts per run: one count for every batch size, or one per batch size, e.g. 1,16,16. "
    "Prompts beyond the batch size stream through its slots, refilled as rows finish. "
    "Default: 32 at batch size 4 (8 per slot, as a job refills them), else one full batch.",
)
@click.option(
    "--max-prompt-tokens",
    type=int,
    default=QUICK["max_prompt_tokens"],
    show_default=True,
    help="Keep each prompt's last N tokens.",
)
@click.option(
    "--draft-vocab",
    type=click.IntRange(0),
    default=0,
    show_default=True,
    help="MTPLX's head scores only this many token ids (MTPContract.draft_vocab); 0 scores them all.",
)
@click.option(
    "--rounds",
    type=click.IntRange(1),
    default=None,
    help="Rounds at every batch size, overriding --repeats' rule (for a large model, whose runs take long).",
)
@click.option(
    "--bare-rounds",
    callback=_csv(int),
    default=f"{BARE_COST_ROUNDS_FIRST},{BARE_COST_ROUNDS_BETWEEN}",
    show_default=True,
    help="Rounds of the bare passes' timing (step, verifies, head) before a batch size's runs, then between "
    "its rounds; fewer for a large model, whose passes take long.",
)
@click.option(
    "--repeats",
    type=int,
    default=QUICK["repeats"],
    show_default=True,
    help="Rounds per setting; each runs mlx-lm once, then every depth, in an order that changes "
    "from round to round so that each depth runs as often in each place and after each other. "
    "Runs of fewer than 8 prompts get 8 // prompts times as many.",
)
@click.option(
    "--seed",
    type=click.IntRange(0, 2**64 - 1),
    default=0,
    show_default=True,
    help="Sampling seed for both engines, so that reruns draw the same tokens.",
)
@click.option("--output", type=click.Path(), default="bench.json", show_default=True, help="Where the JSON records go.")
@click.option(
    "--plot", type=click.Path(), default=None, help="Also draw tokens/s against batch size (needs matplotlib)."
)
@click.option("--quiet", is_flag=True, help="No progress lines; only the final table and file names.")
def bench_cmd(
    model,
    batch_sizes,
    depths,
    temperatures,
    max_tokens,
    num_prompts,
    max_prompt_tokens,
    draft_vocab,
    bare_rounds,
    rounds,
    repeats,
    seed,
    output,
    plot,
    quiet,
):
    """Benchmark MTPLX against mlx_lm.batch_generate, side by side in one run.

    For each batch size and temperature, on the same prompts and trunk, it
    alternates baseline and MTPLX runs (each depth and auto) and reports the
    median of paired ratios, acceptance, and the bare step/verify/head costs
    that bound what speculation can gain.
    """
    from mtplx.bench.report import check_output_paths, format_table, write_plot
    from mtplx.bench.run import prompts_by_batch_size, run_bench

    try:
        check_output_paths(output, plot)
    except (ImportError, RuntimeError, ValueError) as e:
        _fail(str(e))
    try:
        num_prompts = QUICK["num_prompts"] if num_prompts is None else prompts_by_batch_size(num_prompts, batch_sizes)
        records = run_bench(
            model,
            batch_sizes=batch_sizes,
            depths=depths,
            temperatures=temperatures,
            max_tokens=max_tokens,
            num_prompts=num_prompts,
            repeats=repeats,
            seed=seed,
            progress=not quiet,
            max_prompt_tokens=max_prompt_tokens,
            draft_vocab=draft_vocab,
            bare_rounds=tuple(bare_rounds),
            rounds=rounds,
        )
    except (FileNotFoundError, ValueError) as e:
        _fail(str(e))
    Path(output).write_text(json.dumps(records, indent=2))
    click.echo(format_table(records))
    click.echo(f"records: {output}")
    if plot:
        write_plot(records, plot)
        click.echo(f"plot: {plot}")


COMMANDS = [convert_cmd, inspect_model_cmd, train_tiny_cmd, bench_cmd]
