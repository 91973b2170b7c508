"""Sampling settings (`SamplingParams`); the keyed draws and acceptance rules
behind them are in `mtplx.decode.sampling`."""

from mtplx.decode.sampling import SamplingParams

__all__ = ["SamplingParams"]
