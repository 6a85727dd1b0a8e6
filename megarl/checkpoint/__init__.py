"""Atomic save / resume of everything a run needs to continue where it stopped."""


class CheckpointError(RuntimeError):
    """A checkpoint could not be written (disk full, quota, permissions). Nothing of it is
    left behind and the previous complete checkpoint is untouched. (Here, not in manager.py,
    so the CLI can name it without importing megatron before the CPU shim.)"""
