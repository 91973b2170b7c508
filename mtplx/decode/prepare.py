"""The in-place, idempotent changes a model gets before decoding: the
device's forms (`backends.prepare_model`) and the algorithm's own
(`mla.use_one_mla_form`)."""

from __future__ import annotations

from mtplx import backends
from mtplx.decode.mla import use_one_mla_form


def prepare_for_decoding(model) -> None:
    backends.prepare_model(model)
    use_one_mla_form(model)
