"""Where a command's server, token and Prometheus come from: flag > environment > context > default.

The config file (`~/.config/kvctl/config.toml`, or `KVCTL_CONFIG`) holds named contexts, like
kubectl's: `current-context = "prod"` and `[contexts.prod] server = "http://router:7433"`,
`token = "…"`, `prometheus = "http://prom:9090"`, `timeout = 5`, `model = "llama"`. Every resolved value remembers its
source, so `kvctl config show --sources` can say why a command talked to the server it did.
"""

from __future__ import annotations

import math
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvctl.errors import ConfigError

DEFAULTS: dict[str, Any] = {"server": "http://127.0.0.1:7433", "token": None, "prometheus": None, "timeout": 5.0,
                            "model": None}
ENV = {"server": "KVCTL_SERVER", "token": "KVCTL_TOKEN", "prometheus": "KVCTL_PROMETHEUS", "timeout": "KVCTL_TIMEOUT",
       "model": "KVCTL_MODEL"}
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

    @property
    def model(self) -> str | None:
        """The model a command reads when `-m` is not given (a context's, as kubectl's namespace); None: implied."""
        return self.values["model"]


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
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"{path}: {exc}") from None
        current = data.get("current-context")
        if current is not None and not isinstance(current, str):
            raise ConfigError(f"{path}: current-context must be a string (a context's name), got {_shown(current)}")
        contexts = data.get("contexts", {})
        if not isinstance(contexts, dict):
            raise ConfigError(f"{path}: contexts must be [contexts.NAME] tables, got {_shown(contexts)}")
        for name, context in contexts.items():
            if not isinstance(context, dict):
                raise ConfigError(f"{path}: contexts.{name} must be a [contexts.NAME] table, got {_shown(context)}")
            unknown = set(context) - set(KEYS)
            if unknown:
                raise ConfigError(f"{path}: context {name!r}: unknown key {sorted(unknown)[0]!r}",
                                  hint=f"known: {', '.join(KEYS)}")
            for key, value in context.items():
                number = isinstance(value, int | float) and not isinstance(value, bool)
                if not (number if key == "timeout" else isinstance(value, str)):
                    raise ConfigError(f"{path}: context {name!r}: {key} must be a "
                                      f"{'number of seconds' if key == 'timeout' else 'string'}, got {_shown(value)}")
        return cls(path, data)

    @property
    def contexts(self) -> dict[str, dict[str, Any]]:
        return self.data.get("contexts", {})

    @property
    def current(self) -> str | None:
        return self.data.get("current-context")


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def resolve(flags: dict[str, Any], *, context: str | None = None, env: Mapping[str, str] | None = None,
            file: ConfigFile | None = None) -> Settings:
    """Each key from the first of: a flag given, its environment variable, the context, the default."""
    env = os.environ if env is None else env
    file = file if file is not None else ConfigFile.load()
    name = context or env.get("KVCTL_CONTEXT") or file.current
    chosen: dict[str, Any] = {}
    if name is not None:
        if name not in file.contexts:
            named_by = "" if context or env.get("KVCTL_CONTEXT") else " (its current-context)"
            raise ConfigError(f"no context {name!r} in {file.path}{named_by}",
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
        if not 0 < float(values["timeout"]) < math.inf:  # NaN fails this too
            raise ValueError
    except (TypeError, ValueError, OverflowError):
        raise ConfigError(f"timeout must be a positive number of seconds, got {values['timeout']!r} "
                          f"(from {sources['timeout']})") from None
    _check_server(str(values["server"]), sources["server"])
    return Settings(values, sources, name)


def _check_server(server: str, source: str) -> None:
    """A server without its scheme is a usage error, not an unreachable server. No scheme is guessed: a tree
    SOURCE without one is a file, and guessing http where https was meant would send the token in clear."""
    if server.startswith(("http://", "https://")):
        return
    fixed = f"http://{server.split('://', 1)[-1]}"
    if source == "flag":
        raise ConfigError(f"--server {server!r} needs a scheme, http:// or https://", hint=f"--server {fixed}")
    raise ConfigError(f"the server {server!r} (from {source}) needs a scheme, http:// or https://",
                      hint=f"set it to {fixed}")
