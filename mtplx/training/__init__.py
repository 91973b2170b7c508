"""Training the built-in default model (`mtplx train-tiny`).

corpus: the running interpreter's stdlib sources, with fixed held-out modules.
tokenizer: a byte-level BPE in the Qwen pipeline, trained on that corpus.
model: the qwen3_5 trunk (mlx-lm's classes) and MTPLX's own Qwen MTP head.
train: the joint trunk + MTP loss and the compiled training loop.
export: the Hugging Face checkpoint layout that `mtplx.load` reads.
evaluate: held-out loss, teacher-forced acceptance and head/trunk cost.
"""
