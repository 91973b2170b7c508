"""Training the built-in default model (`mtplx train-tiny`, in `tiny`): the interpreter's stdlib sources as
corpus, a byte-level BPE in the Qwen pipeline, mlx-lm's qwen3_5 trunk with MTPLX's Qwen MTP head trained
jointly, exported in the Hugging Face layout `mtplx.load` reads, and measured on held-out modules.
"""
