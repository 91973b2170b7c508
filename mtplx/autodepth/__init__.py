"""Depth "auto": calibration at the job's batch size and the per-cycle depth controller."""
