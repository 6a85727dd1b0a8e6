"""Atomic save / resume of everything a run needs to continue where it stopped."""
