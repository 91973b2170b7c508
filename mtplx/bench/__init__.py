"""`mtplx bench`: MTPLX against mlx-lm's `batch_generate` on the same model and prompts."""
