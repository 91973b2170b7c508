"""MTPLX: a batched MLX decoder that speculates with the model's own MTP head.

The package imports lazily so that `import mtplx` stays cheap and never pulls
in pyarrow or the CLI.
"""

__version__ = "0.1.0"

_EXPORTS = {
    "load": "mtplx.loader",
    "MTPModel": "mtplx.loader",
    "MTPContract": "mtplx.mtp_patch",
    "MTPLXRuntime": "mtplx.runtime",
    "Completion": "mtplx.runtime",
    "Request": "mtplx.runtime",
    "SamplingParams": "mtplx.sampling",
}


def __getattr__(name):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'mtplx' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


__all__ = sorted(_EXPORTS)
