"""Multi-turn environments: the protocol (`base`), the built-in ones (`builtin`), the loop
they run on (`runner`) and how their text becomes tokens (`render`). docs/agents.md."""
