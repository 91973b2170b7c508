"""Package data: the built-in default model (see `mtplx train-tiny`)."""

from pathlib import Path

DEFAULT_MODEL_DIR = Path(__file__).parent / "tiny"


def default_model_path() -> Path:
    """The shipped default model; a clear error if this install lacks it."""
    if not (DEFAULT_MODEL_DIR / "config.json").exists():
        raise FileNotFoundError(
            f"the built-in default model is missing at {DEFAULT_MODEL_DIR}; "
            "pass --model DIR or rebuild it with `mtplx train-tiny`"
        )
    return DEFAULT_MODEL_DIR
