"""Importing this module registers every built-in environment (ENVIRONMENTS' home)."""
from megarl.envs import guess, tool_math  # noqa: F401 - importing them registers their environments
