"""The error every config check raises (schema, registries, preflight)."""


class ConfigError(ValueError):
    """A recipe or command-line override that cannot run; the message says how to fix it."""
