"""Depth "auto": calibration on this machine and the per-cycle depth controller."""
