"""MTPLX: a batched MLX decoder that speculates with the model's own MTP head.

Exports load lazily, so that `import mtplx` stays cheap and never pulls in pyarrow or the CLI."""

from mtplx.install_check import check_mlx_backend

__version__ = "0.1.0"

check_mlx_backend()  # on Linux, one line naming the extras rather than MLX's "cannot open libmlx.so"

_EXPORTS = {
    "load": "mtplx.models.loader",
    "MTPModel": "mtplx.models.loader",
    "load_tokenizer": "mtplx.models.loader",
    "encode_text": "mtplx.models.loader",
    "CheckpointError": "mtplx.models.adapter",
    "supported_model_types": "mtplx.models.families",
    "MTPContract": "mtplx.decode.contract",
    "MAX_DEPTH": "mtplx.decode.contract",
    "MTPLXRuntime": "mtplx.runtime",
    "Completion": "mtplx.decode.requests",
    "Request": "mtplx.decode.requests",
    "SamplingParams": "mtplx.decode.sampling",
    "default_model_path": "mtplx.assets",
}


def __getattr__(name):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'mtplx' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


__all__ = sorted(_EXPORTS)
