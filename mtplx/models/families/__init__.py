"""The model families MTPLX decodes, by config `model_type`."""

from __future__ import annotations

from typing import Dict

from mtplx.models.adapter import CheckpointError, FamilyAdapter
from mtplx.models.families.deepseek import DEEPSEEK
from mtplx.models.families.mimo import MIMO
from mtplx.models.families.qwen import QWEN

FAMILIES: Dict[str, FamilyAdapter] = {mt: a for a in (QWEN, DEEPSEEK, MIMO) for mt in a.model_types}


def supported_model_types() -> list:
    return sorted(FAMILIES)


def family_for(config: dict) -> FamilyAdapter:
    model_type = config.get("model_type")
    if model_type not in FAMILIES:
        raise CheckpointError(f"unsupported model_type {model_type!r}; MTPLX supports: " + ", ".join(sorted(FAMILIES)))
    return FAMILIES[model_type]
