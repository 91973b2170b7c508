"""The CPU backend's own forms (chosen only through `mtplx.backends`)."""
