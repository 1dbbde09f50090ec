"""The errors whose message already says what to fix, at the bottom of the import graph: `storage`, the config
modules, the CLI and the trainer all import them from here, and this module imports nothing of the project (nor
JAX), so the lowest layers need not load the config or the methods to raise one."""


class ConfigError(ValueError):
    """A configuration mistake; the message names the key, the source and what to do."""
