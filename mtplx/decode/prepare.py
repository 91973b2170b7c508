"""The in-place, idempotent changes a model gets before decoding: the
device's forms (`backends.prepare_model`) and the algorithm's own
(`mla.use_one_mla_form`)."""

from __future__ import annotations

from mtplx import backends
from mtplx.decode.mla import use_one_mla_form
from mtplx.models import draft_vocab


def prepare_for_decoding(model) -> None:
    backends.prepare_model(model)
    use_one_mla_form(model)


def drafting_model(model, contract):
    """`model` as the contract drafts with it: its head scoring `contract.draft_vocab` ids in merge order, unless
    the caller already chose a draft vocabulary (`models.draft_vocab.with_draft_vocab`)."""
    if not contract.draft_vocab or model.draft_ids is not None or model.head is None:
        return model
    if contract.draft_vocab >= draft_vocab.output_rows(model):
        return model  # the whole layer: nothing to cut
    return draft_vocab.with_draft_vocab(model, draft_vocab.merge_order_ids(model, contract.draft_vocab))
