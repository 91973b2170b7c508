"""Checkpoints: loading MTP releases, their model families, conversion and description."""
