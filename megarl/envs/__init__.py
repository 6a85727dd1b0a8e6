"""Multi-turn environments: the protocol (`base`), the built-in ones (`builtin`), the loop
they run on (`runner`) and how their text becomes tokens (`render`). A user's own is named by
import path, env.name=package.module:Class or path/to/file.py:Class (`base.spec_from_import`),
loaded when the config is read. docs/agents.md."""
