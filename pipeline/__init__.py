"""The MTPLX job runner: job specs, Parquet in and out, resume, metrics, CLI."""
