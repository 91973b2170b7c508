"""The `mtplx` command line."""

import click

from .blas import reexec_with_openblas


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="mtplx")
def cli():
    """MTPLX: batched offline LLM completions over Parquet datasets, sped up
    by speculative decoding with the model's own multi-token-prediction head.

    \b
    Start with:
      mtplx run jobs/nightly.toml          run a job spec
      mtplx generate --input P --output O  a job from flags
      mtplx inspect OUT                    summarise an output directory
    """


def main():
    reexec_with_openblas()
    cli()


if __name__ == "__main__":
    main()
