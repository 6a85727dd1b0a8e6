"""The tools that build the tiny demo models and their data, by the folder each builds (the
Makefile's defaults), so an error about a missing model folder or prompts file names the one
that makes it rather than a builder of something else."""
from __future__ import annotations

from pathlib import PurePath

#: folder name -> (make target, builder, what it builds)
BUILDERS = {
    "tiny_countdown": ("make model", "tools/make_tiny_model.py", "the countdown task's model and prompts"),
    "tiny_guess": ("make agent-model", "tools/make_tiny_agent_model.py",
                   "the guess-the-number agent's model and tasks"),
}


def how_to_build(path: str) -> str:
    """'build it with ...' for a path inside a folder a tiny builder makes (named with its
    --out); for any other path, both builders and what each builds."""
    parts = PurePath(path).parts
    for folder, (make, tool, _) in BUILDERS.items():
        if folder in parts:
            out = PurePath(*parts[:parts.index(folder) + 1])
            return f"build it with `{make}` (`python {tool} --out {out}`)"
    each = "; ".join(f"`python {tool} --out DIR` builds {what}" for make, tool, what in BUILDERS.values())
    return f"build a tiny demo ({each})"
