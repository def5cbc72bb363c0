"""The client's config: which router, token and Prometheus a command uses (`settings`), and the config file
written back atomically (`writer`). The reading side is imported from here, as it was before the package."""

from kvctl.config.settings import DEFAULTS, ENV, KEYS, ConfigFile, Settings, config_path, resolve

__all__ = ["DEFAULTS", "ENV", "KEYS", "ConfigFile", "Settings", "config_path", "resolve"]
