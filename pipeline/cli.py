"""The `mtplx` command line.

Exit codes: 0 ok; 1 the job finished but some rows have errors (their count is
printed); 2 bad job (one line on stderr names the problem); 70 an unexpected
failure (one line names it, the traceback goes to OUT/.mtplx/crash-*.log);
128 + N when stopped by signal N (SIGINT 130, SIGTERM 143) after saving
finished rows.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from .errors import EXIT_BAD_JOB, EXIT_CRASH, JobError

try:
    import mtplx  # noqa: F401  (first, so that an MLX install without a backend is one line, not a traceback)
except ImportError as e:
    click.echo(f"mtplx: {e}", err=True)
    sys.exit(EXIT_BAD_JOB)

from .preload import reexec_with_preloads  # noqa: E402


class DepthType(click.ParamType):
    name = "K|auto"

    def convert(self, value, param, ctx):
        if value == "auto" or isinstance(value, int):
            return value
        try:
            k = int(value)
        except ValueError:
            self.fail(f"{value!r} is not an integer or 'auto'", param, ctx)
        from mtplx import MAX_DEPTH

        if not 0 <= k <= MAX_DEPTH:
            self.fail(f"depth must be in 0..{MAX_DEPTH} (or 'auto')", param, ctx)
        return k


class MemoryType(click.ParamType):
    name = "SIZE"

    def convert(self, value, param, ctx):
        from .spec import parse_memory

        try:
            return parse_memory("--max-memory", value)
        except JobError as e:
            self.fail(str(e), param, ctx)


def _run_options(f):
    f = click.option(
        "--share-prefix-min",
        type=click.IntRange(0),
        default=None,
        help="Prompts that begin with the same N or more tokens (a system prompt, few-shot examples) "
        "prefill them once and copy the state; outputs do not change. 0 turns it off "
        "[default: the spec's [batch] share_prefix_min, else 64].",
    )(f)
    f = click.option(
        "--max-memory",
        type=MemoryType(),
        default=None,
        help="Memory cap, e.g. 8GB or 512MiB: the runtime's slot count and prefill chunk are sized "
        "to fit it (an estimate from the checkpoint; see docs/pipeline.md).",
    )(f)
    f = click.option(
        "--logprobs",
        is_flag=True,
        help="Add a `logprobs` column: the log-probability of each completion token under the target model.",
    )(f)
    f = click.option(
        "--quiet", "-q", is_flag=True, help="No progress bar or info lines (for cron); errors still go to stderr."
    )(f)
    f = click.option(
        "--dry-run",
        is_flag=True,
        help="Validate the spec and input, count rows and prompt tokens, "
        "report row errors already visible and the planned output; "
        "the weights are not loaded and nothing is written.",
    )(f)
    f = click.option(
        "--retry-errors",
        is_flag=True,
        help="Resume, and run again the rows a previous run wrote with an error (they are taken out "
        "of their part files first). Default: a resumed job keeps them as they are.",
    )(f)
    f = click.option(
        "--overwrite",
        is_flag=True,
        help="Remove a previous run's parts, manifest and summary in the "
        "output directory and start over (default: resume).",
    )(f)
    return f


# ctx.meta key: the running job's output directory, where a crash's traceback goes.
OUTPUT_DIR = "mtplx.output_dir"


class _Group(click.Group):
    """Turns a JobError anywhere below, or a bad command line, into one line
    on stderr and exit 2; an unexpected failure into one line and exit 70."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except JobError as e:
            click.echo(f"mtplx: error: {e}", err=True)
            ctx.exit(EXIT_BAD_JOB)
        except click.UsageError as e:  # an option's value, a missing option, an unknown command
            _usage_error(ctx, e)
        except KeyboardInterrupt:  # before the job installed its own handler
            click.echo("mtplx: interrupted", err=True)
            ctx.exit(130)
        except (click.exceptions.Exit, click.exceptions.Abort, click.ClickException):
            raise
        except Exception as e:  # a bug, not the job: its own exit code, never 0, 1 or 2
            from .crash import report_crash

            click.echo(report_crash(e, ctx.meta.get(OUTPUT_DIR)), err=True)
            ctx.exit(EXIT_CRASH)

    def parse_args(self, ctx, args):
        try:
            return super().parse_args(ctx, args)
        except click.UsageError as e:  # the group's own options
            _usage_error(ctx, e)


def _usage_error(ctx, e: click.UsageError):
    if type(e).__name__ == "NoArgsIsHelpError":  # bare `mtplx` (click >= 8.2): the help, as click shows it
        raise e
    where = e.ctx.command_path if e.ctx is not None else ctx.command_path
    click.echo(f"mtplx: error: {e.format_message()} (see {where} --help)", err=True)
    ctx.exit(EXIT_BAD_JOB)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="mtplx")
def cli():
    """MTPLX: batched offline LLM completions over Parquet datasets, sped up
    by speculative decoding with the model's own multi-token-prediction head.

    \b
    Start with:
      mtplx run jobs/nightly.toml          run a job spec
      mtplx generate --input P --output O  a job from flags
      mtplx inspect OUT                    summarise an output directory

    \b
    Exit codes: 0 ok, 1 finished with row errors (count shown),
    2 bad job (one line names the problem), 70 unexpected failure (one line;
    the traceback goes to OUT/.mtplx/crash-*.log), 130/143 stopped by
    SIGINT/SIGTERM (finished rows are saved; rerun the same command to resume).
    """


@cli.command("run")
@click.argument("job", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--model", "model", default=None, help="Checkpoint directory to use instead of the spec's [model] path.")
@click.option(
    "--output",
    "output",
    default=None,
    type=click.Path(path_type=Path),
    help="Output directory to use instead of the spec's [output] path.",
)
@click.option(
    "--engine",
    type=click.Choice(["local", "ray"]),
    default=None,
    help="Where the job runs: this process (local) or a Ray cluster (ray; needs "
    "pip install 'mtplx[ray]', see docs/ray.md) [default: the spec's engine, else local].",
)
@click.option(
    "--address",
    default=None,
    help="Ray cluster address (e.g. auto, HEAD:6379, ray://HEAD:10001) "
    "instead of the spec's [ray] address; with --engine ray.",
)
@click.option(
    "--actors",
    type=click.IntRange(1),
    default=None,
    help="Ray actors (model copies), instead of the spec's [ray] actors [default: one per node "
    "advertising the mlx resource, else one per node]; with --engine ray.",
)
@_run_options
def run_cmd(
    job,
    model,
    output,
    engine,
    address,
    actors,
    overwrite,
    retry_errors,
    dry_run,
    quiet,
    logprobs,
    max_memory,
    share_prefix_min,
):
    """Run the job spec JOB (TOML).

    Rows are written to part-NNNNN.parquet files in the spec's [output] path,
    with .mtplx/summary.json at the end. Running the same job on the same output
    directory resumes where it stopped, also after kill -9; a changed spec,
    model or input there is refused unless --overwrite is given.
    See docs/pipeline.md for every spec key.
    """
    from dataclasses import replace

    from .spec import load_spec

    _check_resume_flags(overwrite, retry_errors)
    spec = load_spec(job)
    if model:
        spec = replace(spec, model=replace(spec.model, path=str(Path(model).expanduser())))
    if output:
        spec = replace(spec, output=replace(spec.output, path=str(Path(output).expanduser())))
    spec = _with_engine(spec, engine, address, actors)
    _execute(spec, overwrite, retry_errors, dry_run, quiet, logprobs, max_memory, share_prefix_min)


def _with_engine(spec, engine, address, actors):
    from dataclasses import replace

    if engine:
        spec = replace(spec, engine=engine)
    if (address or actors) and spec.engine != "ray":
        raise JobError(
            '--address and --actors apply to the Ray engine: add --engine ray (or engine = "ray" in the spec)'
        )
    ray = spec.ray
    if address:
        ray = replace(ray, address=address)
    if actors:
        ray = replace(ray, actors=actors)
    return replace(spec, ray=ray)


@cli.command("generate")
@click.option("--input", "input_path", required=True, help="Parquet file, directory or glob of prompts.")
@click.option(
    "--output",
    "output_path",
    required=True,
    type=click.Path(path_type=Path),
    help="Output directory: the part files, a Parquet dataset any reader opens (the job's manifest "
    "and summary go to OUT/.mtplx/).",
)
@click.option("--model", default=None, help="Checkpoint directory (default: the built-in model).")
@click.option("--prompt-column", default="prompt", show_default=True, help="Column holding the prompt text.")
@click.option(
    "--messages-column",
    default=None,
    help="Use a column of chat messages instead (OpenAI format; the tokenizer's chat template is applied).",
)
@click.option(
    "--id-column",
    default=None,
    help="Column of unique row ids [default: `id` when the input has one, else the row index]; "
    "'' keys the rows by row index even when the input has an `id` column.",
)
@click.option("--keep-column", "keep_columns", multiple=True, help="Input column to copy into the output (repeatable).")
@click.option(
    "--depth",
    type=DepthType(),
    default=2,
    show_default=True,
    help="MTP draft tokens per cycle; 0 decodes plainly; 'auto' picks from a cost model.",
)
@click.option(
    "--draft-vocab",
    type=click.IntRange(0),
    default=0,
    show_default=True,
    help="The MTP head scores only this many token ids (the tokenizer's first, in merge order): drafts cost "
    "less with a large vocabulary, and output stays exact. 0 scores the whole vocabulary.",
)
@click.option(
    "--batch-size",
    type=click.IntRange(1),
    default=16,
    show_default=True,
    help="Decode slots (rows at once); a job with fewer rows left uses one slot per row.",
)
@click.option(
    "--max-tokens", type=click.IntRange(1), default=256, show_default=True, help="Tokens per completion at most."
)
@click.option("-n", "--n", "n", type=click.IntRange(1), default=1, show_default=True, help="Samples per prompt.")
@click.option("--temperature", type=click.FloatRange(0), default=0.0, show_default=True, help="0 = greedy.")
@click.option(
    "--top-p",
    type=click.FloatRange(0, 1, min_open=True),
    default=1.0,
    show_default=True,
    help="Nucleus sampling: draw from the most likely tokens holding this much probability; 1 = off.",
)
@click.option("--top-k", type=click.IntRange(0), default=0, show_default=True, help="0 = off.")
@click.option(
    "--min-p",
    type=click.FloatRange(0, 1, max_open=True),
    default=0.0,
    show_default=True,
    help="Drop tokens less likely than this fraction of the most likely token's probability; 0 = off.",
)
@click.option(
    "--seed",
    type=click.IntRange(0),
    default=0,
    show_default=True,
    help="Job seed; with the row id it keys every random draw.",
)
@click.option("--stop", multiple=True, help="Stop string (repeatable).")
@click.option(
    "--flush-rows",
    type=click.IntRange(1),
    default=1000,
    show_default=True,
    help="Write a part file every this many rows.",
)
@_run_options
def generate_cmd(
    input_path,
    output_path,
    model,
    prompt_column,
    messages_column,
    id_column,
    keep_columns,
    depth,
    draft_vocab,
    batch_size,
    max_tokens,
    n,
    temperature,
    top_p,
    top_k,
    min_p,
    seed,
    stop,
    flush_rows,
    overwrite,
    retry_errors,
    dry_run,
    quiet,
    logprobs,
    max_memory,
    share_prefix_min,
):
    """Complete every prompt of a Parquet input: a job from flags, run by the
    same engine as `mtplx run` (same output, resume and exit codes).

    \b
    mtplx generate --input IN --output OUT [--model DIR]
        [--prompt-column COL | --messages-column COL] [--id-column COL]
        [--keep-column COL ...] [--depth K|auto] [--draft-vocab N] [--batch-size N]
        [--max-tokens N] [-n|--n N] [--temperature T] [--top-p P] [--top-k K]
        [--min-p P] [--seed S] [--stop TEXT ...] [--flush-rows N]
        [--overwrite | --retry-errors] [--dry-run] [--quiet] [--logprobs]
        [--max-memory SIZE] [--share-prefix-min N]
    """
    from .spec import spec_from_dict

    _check_resume_flags(overwrite, retry_errors)
    doc = {
        "name": "generate",
        "model": {"depth": depth, "draft_vocab": draft_vocab, **({"path": model} if model else {})},
        "input": {"path": input_path, "keep_columns": list(keep_columns)},
        "prompt": {"messages": messages_column} if messages_column else {"column": prompt_column},
        "sampling": {"temperature": temperature, "top_p": top_p, "top_k": top_k, "min_p": min_p, "seed": seed},
        "generation": {"max_tokens": max_tokens, "n": n, "stop": list(stop)},
        "batch": {"max_batch": batch_size},
        "output": {"path": str(output_path), "flush_rows": flush_rows},
    }
    defaulted = id_column is None
    if defaulted:
        id_column = _default_id_column(input_path, output_path)
    if id_column is not None:  # "" keys the rows by row index
        doc["input"]["id_column"] = id_column
    spec = spec_from_dict(doc)
    try:
        _execute(spec, overwrite, retry_errors, dry_run, quiet, logprobs, max_memory, share_prefix_min)
    except JobError as e:
        if defaulted and id_column and str(e).startswith(f"id column {id_column!r}") and "--id-column" not in str(e):
            raise JobError(
                f"{e} (the input's {id_column!r} column was taken as the row ids; "
                f"--id-column '' keys the rows by row index)"
            ) from None
        raise


def _default_id_column(input_path: str, output_path: Path):
    from .inputs import open_input
    from .spec import InputSpec

    # Without the output directory: a previous run's parts may lie inside the input.
    names = open_input(InputSpec(path=input_path), exclude=output_path).column_names()
    return "id" if "id" in names else None


@cli.command("inspect")
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON instead of a table.")
def inspect_cmd(out, as_json):
    """Print the summary of the output directory OUT and its acceptance by
    depth. For a job still running or stopped, totals come from its parts."""
    from .summary import format_summary, load_or_compute

    s = load_or_compute(out)
    click.echo(json.dumps(s, indent=2) if as_json else format_summary(s))


def _check_resume_flags(overwrite: bool, retry_errors: bool) -> None:
    if overwrite and retry_errors:
        raise JobError("--overwrite and --retry-errors do not go together: --overwrite starts over and runs every row")


def _execute(spec, overwrite, retry_errors, dry_run, quiet, logprobs, max_memory, share_prefix_min=None):
    from .runner import RunOptions, run_job

    opts = RunOptions(
        overwrite=overwrite,
        retry_errors=retry_errors,
        dry_run=dry_run,
        quiet=quiet,
        logprobs=logprobs,
        max_memory=max_memory,
        share_prefix_min=share_prefix_min,
    )
    log = (lambda line: None) if quiet else (lambda line: click.echo(line, err=True))
    click.get_current_context().meta[OUTPUT_DIR] = Path(spec.output.path)
    result = run_job(spec, opts, log=log)
    if dry_run or not quiet:
        for line in result.report:
            click.echo(line)
    for line in result.warnings:
        click.echo(line, err=True)
    sys.exit(result.exit_code)


def _add_model_commands() -> None:
    """convert, inspect-model, train-tiny, bench: defined in model_cli.py."""
    try:
        from .model_cli import COMMANDS
    except ModuleNotFoundError:
        return
    for command in COMMANDS:
        cli.add_command(command)


_add_model_commands()


def main():
    reexec_with_preloads()
    try:
        cli(prog_name="mtplx")
    except Exception as e:  # outside any command (the command line's own parsing, an import)
        from .crash import report_crash

        click.echo(report_crash(e, None), err=True)
        sys.exit(EXIT_CRASH)


if __name__ == "__main__":
    main()
