"""Where a command's server, token and Prometheus come from: flag > environment > context > default.

The config file (`~/.config/kvctl/config.toml`, or `KVCTL_CONFIG`) holds named contexts, like
kubectl's: `current-context = "prod"` and `[contexts.prod] server = "http://router:7433"`,
`token = "…"`, `prometheus = "http://prom:9090"`, `timeout = 5`. Every resolved value remembers its
source, so `kvctl config show --sources` can say why a command talked to the server it did.
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvctl.errors import ConfigError

DEFAULTS: dict[str, Any] = {"server": "http://127.0.0.1:7433", "token": None, "prometheus": None, "timeout": 5.0}
ENV = {"server": "KVCTL_SERVER", "token": "KVCTL_TOKEN", "prometheus": "KVCTL_PROMETHEUS", "timeout": "KVCTL_TIMEOUT"}
KEYS = tuple(DEFAULTS)


def config_path() -> Path:
    explicit = os.environ.get("KVCTL_CONFIG")
    if explicit:
        return Path(explicit)
    base = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")
    return base / "kvctl" / "config.toml"


@dataclass(frozen=True)
class Settings:
    values: dict[str, Any]
    sources: dict[str, str]  # key -> "flag", "env KVCTL_…", "context NAME (path)", "default"
    context: str | None = None

    @property
    def server(self) -> str:
        return str(self.values["server"]).rstrip("/")

    @property
    def token(self) -> str | None:
        return self.values["token"]

    @property
    def prometheus(self) -> str | None:
        return self.values["prometheus"]

    @property
    def timeout(self) -> float:
        return float(self.values["timeout"])


@dataclass
class ConfigFile:
    path: Path
    data: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def load(cls, path: Path | None = None) -> ConfigFile:
        path = path or config_path()
        if not path.exists():
            return cls(path)
        try:
            data = tomllib.loads(path.read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"{path}: {exc}") from None
        contexts = data.get("contexts", {})
        if not isinstance(contexts, dict) or not all(isinstance(c, dict) for c in contexts.values()):
            raise ConfigError(f"{path}: [contexts.NAME] tables expected")
        for name, context in contexts.items():
            unknown = set(context) - set(KEYS)
            if unknown:
                raise ConfigError(f"{path}: context {name!r}: unknown key {sorted(unknown)[0]!r}",
                                  hint=f"known: {', '.join(KEYS)}")
        return cls(path, data)

    @property
    def contexts(self) -> dict[str, dict[str, Any]]:
        return self.data.get("contexts", {})

    @property
    def current(self) -> str | None:
        return self.data.get("current-context")


def resolve(flags: dict[str, Any], *, context: str | None = None, env: dict[str, str] | None = None,
            file: ConfigFile | None = None) -> Settings:
    """Each key from the first of: a flag given, its environment variable, the context, the default."""
    env = os.environ if env is None else env  # type: ignore[assignment]
    file = file if file is not None else ConfigFile.load()
    name = context or env.get("KVCTL_CONTEXT") or file.current
    chosen: dict[str, Any] = {}
    if name is not None:
        if name not in file.contexts:
            raise ConfigError(f"no context {name!r} in {file.path}",
                              hint=f"known: {', '.join(sorted(file.contexts)) or 'none'}")
        chosen = file.contexts[name]
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for key in KEYS:
        if flags.get(key) is not None:
            values[key], sources[key] = flags[key], "flag"
        elif env.get(ENV[key]):
            values[key], sources[key] = env[ENV[key]], f"env {ENV[key]}"
        elif key in chosen:
            values[key], sources[key] = chosen[key], f"context {name} ({file.path})"
        else:
            values[key], sources[key] = DEFAULTS[key], "default"
    try:
        if float(values["timeout"]) <= 0:
            raise ValueError
    except (TypeError, ValueError):
        raise ConfigError(f"timeout must be a positive number of seconds, got {values['timeout']!r} "
                          f"(from {sources['timeout']})") from None
    return Settings(values, sources, name)
