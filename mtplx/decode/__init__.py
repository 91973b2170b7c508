"""Decoding: the batched speculative decode loop, its caches, draws and acceptance rules."""
