"""Settings from the environment: TIERCACHE_SECTION__KEY variables, read over a
configuration file's values, and secrets read from the files NAME_FILE variables
name (a mounted Secret, a Docker secret)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from tiercache.errors import ConfigError

ENV_PREFIX = "TIERCACHE_"


def env_overrides(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """TIERCACHE_CPU__CAPACITY=4GiB -> {"cpu": {"capacity": "4GiB"}} (YAML-typed values)."""
    environ = os.environ if environ is None else environ
    for secret in _VERBATIM_ENV:
        if environ.get(secret) and environ.get(secret + _FILE_SUFFIX):
            raise ConfigError("environment", [f"{secret} and {secret}{_FILE_SUFFIX} are both set: set one"])
    overrides: dict[str, Any] = {}
    for name, raw in environ.items():
        if not name.startswith(ENV_PREFIX) or name in _NOT_CONFIG_ENV:
            continue
        if name.removesuffix(_FILE_SUFFIX) in _VERBATIM_ENV and name.endswith(_FILE_SUFFIX):
            name, raw = name.removesuffix(_FILE_SUFFIX), _read_secret_file(name, raw)
        path = [part.lower() for part in name[len(ENV_PREFIX) :].split("__")]
        node = overrides
        for part in path[:-1]:
            node = node.setdefault(part, {})
        if name in _VERBATIM_ENV:
            node[path[-1]] = raw
            continue
        value = yaml.safe_load(raw) if raw.strip() else None
        node[path[-1]] = raw if isinstance(value, (dict, list)) else value
    return overrides


# Environment variables that configure the process, not the cache (the service's
# tokens: tiercache.ops.service.auth).
_NOT_CONFIG_ENV = {
    "TIERCACHE_ADMIN_TOKEN",
    "TIERCACHE_ADMIN_TOKEN_FILE",
    "TIERCACHE_LOOKUP_TOKEN",
    "TIERCACHE_LOOKUP_TOKEN_FILE",
    "TIERCACHE_LOOKUP_TOKENS_DIR",
    "TIERCACHE_CONFIG",
    "TIERCACHE_LOG_LEVEL",
}
# Secrets taken as written: YAML would turn a key of digits into a number. Each may
# also come from a file that NAME_FILE names (a mounted Secret, a Docker secret).
_VERBATIM_ENV = {"TIERCACHE_INTEGRITY_KEY"}
_FILE_SUFFIX = "_FILE"


def _read_secret_file(variable: str, path: str) -> str:
    """The secret in the file `variable` names, without its trailing newline."""
    try:
        return Path(path).read_text(encoding="utf-8", errors="surrogateescape").strip()
    except OSError as error:
        raise ConfigError("environment", [f"{variable}: cannot read {path}: {error.strerror}"]) from None
