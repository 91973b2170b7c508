"""The in-place changes a model gets before MTPLX decodes with it: the
device's forms (`mtplx.backends.prepare_model`) and the one form of the
algorithm's own that every device takes (`mla.use_one_mla_form`). The
runtime applies them, and the bare-cost passes time the model as the runtime
runs it; each is idempotent."""

from __future__ import annotations

from mtplx import backends
from mtplx.decode.mla import use_one_mla_form


def prepare_for_decoding(model) -> None:
    backends.prepare_model(model)
    use_one_mla_form(model)
