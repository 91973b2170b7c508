"""MTPLXRuntime: the batched decode loop with the depth policy its contract asks for (fixed, or "auto")."""

from __future__ import annotations

from mtplx.autodepth import calibration
from mtplx.decode.contract import MTPContract
from mtplx.decode.depth import FixedDepth
from mtplx.decode.prepare import drafting_model
from mtplx.decode.requests import Completion, Request
from mtplx.decode.runtime import BatchRuntime, check_runtime_args

__all__ = ["MTPLXRuntime", "Completion", "Request", "depth_policy"]


def depth_policy(model, contract: MTPContract, max_batch: int):
    """`FixedDepth`, or for "auto" the `AutoDepth` that calibration plans at this batch size."""
    if contract.depth == "auto":
        return calibration.plan_auto_depth(model, contract, max_batch)
    return FixedDepth(contract.depth)


class MTPLXRuntime(BatchRuntime):
    """Decode prompts in batches of `max_batch` rows, speculating as `contract`
    says. `policy` overrides the depth policy (`mtplx.decode.depth`)."""

    def __init__(self, model, contract: MTPContract = MTPContract(), max_batch: int = 8, policy=None):
        check_runtime_args(model, contract, max_batch)
        model = drafting_model(model, contract)  # calibration times the head the runtime drafts with
        super().__init__(model, contract, max_batch, policy or depth_policy(model, contract, max_batch))
