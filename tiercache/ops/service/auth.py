"""Who may call what: the bearer tokens of the lookup API and of the admin endpoints.

Tokens come from the environment or from files (a mounted Secret), never from the
tiercache config, which is logged and shown by `config check`:

- TIERCACHE_ADMIN_TOKEN (or TIERCACHE_ADMIN_TOKEN_FILE): the admin endpoints (flush,
  GC), and lookups in any namespace. Unset: the admin endpoints answer 403.
- TIERCACHE_LOOKUP_TOKEN (or TIERCACHE_LOOKUP_TOKEN_FILE): lookups in any namespace,
  for a request router that serves them all.
- TIERCACHE_LOOKUP_TOKENS_DIR: a folder holding one file per namespace, named after
  it, whose content is the token for lookups in that namespace only (a Kubernetes
  Secret mounted as a volume, one key per namespace).

With no lookup token and no namespace token configured, lookups are open, as before
tokens existed: a service bound to loopback for one router keeps working without a
secret to hand around. `serve` warns about it at start; the chart and compose always
configure a token.

Every check hashes the token it is given and compares the SHA-256 digest with each
configured token's, all of them, in constant time: neither how much of a guess
matches nor its length shows in how long the answer takes. A missing or wrong token
gets the same 401, which names nothing of what the cache holds."""

from __future__ import annotations

import hashlib
import hmac
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from tiercache.ops.service.models import NAMESPACE_PATTERN

ADMIN_TOKEN_ENV = "TIERCACHE_ADMIN_TOKEN"
LOOKUP_TOKEN_ENV = "TIERCACHE_LOOKUP_TOKEN"
LOOKUP_TOKENS_DIR_ENV = "TIERCACHE_LOOKUP_TOKENS_DIR"
# NAME_FILE names a file holding NAME's value (the Docker and Kubernetes convention).
FILE_SUFFIX = "_FILE"
# Token files are small; anything larger is a wrong path, not a token.
MAX_TOKEN_FILE_BYTES = 4096

_NAMESPACE = re.compile(NAMESPACE_PATTERN)


class TokenError(ValueError):
    """A token setting that cannot be used; the message names the variable or file,
    never the token."""


def _read_token_file(path: Path, setting: str) -> str:
    try:
        with path.open("rb") as file:
            raw = file.read(MAX_TOKEN_FILE_BYTES + 1)
    except OSError as error:
        raise TokenError(f"{setting}: cannot read {path}: {error.strerror}") from None
    if len(raw) > MAX_TOKEN_FILE_BYTES:
        raise TokenError(f"{setting}: {path} is over {MAX_TOKEN_FILE_BYTES} bytes, not a token")
    # `kubectl create secret --from-file` and editors leave a trailing newline.
    token = raw.decode("utf-8", "surrogateescape").strip()
    if not token:
        raise TokenError(f"{setting}: {path} is empty")
    return token


def read_token(name: str, environ: Mapping[str, str]) -> str | None:
    """The token in variable `name`, or in the file `name`_FILE names; None when
    neither is set (an empty variable counts as unset)."""
    value = environ.get(name) or None
    path = environ.get(name + FILE_SUFFIX) or None
    if value is not None and path is not None:
        raise TokenError(f"{name} and {name}{FILE_SUFFIX} are both set: set one of them")
    if path is not None:
        return _read_token_file(Path(path), name + FILE_SUFFIX)
    return value


def read_namespace_tokens(directory: Path) -> dict[str, str]:
    """namespace -> token, from one file per namespace in `directory`. Names that
    start with a dot are skipped: a mounted Secret keeps its data behind `..data`."""
    setting = LOOKUP_TOKENS_DIR_ENV
    if not directory.is_dir():
        raise TokenError(f"{setting}: {directory} is not a folder")
    tokens: dict[str, str] = {}
    for entry in sorted(directory.iterdir()):
        if entry.name.startswith("."):
            continue
        if not _NAMESPACE.match(entry.name) or len(entry.name) > 128:
            raise TokenError(f"{setting}: {entry.name!r} in {directory} is not a namespace name")
        if entry.is_file():
            tokens[entry.name] = _read_token_file(entry, setting)
    return tokens


@dataclass(frozen=True)
class ServiceTokens:
    """The tokens one service process accepts."""

    admin: str | None = None
    # Lookups in every namespace (a router that serves them all).
    lookup: str | None = None
    # namespace -> the token for lookups in that namespace only.
    namespaces: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> ServiceTokens:
        environ = os.environ if environ is None else environ
        directory = environ.get(LOOKUP_TOKENS_DIR_ENV) or None
        return cls(
            admin=read_token(ADMIN_TOKEN_ENV, environ),
            lookup=read_token(LOOKUP_TOKEN_ENV, environ),
            namespaces=read_namespace_tokens(Path(directory)) if directory else {},
        )

    @property
    def lookups_open(self) -> bool:
        """True when no lookup token is configured: lookups need none."""
        return self.lookup is None and not self.namespaces


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogateescape")).digest()


@dataclass(frozen=True)
class Grant:
    """What a request's bearer token allows."""

    admin: bool = False
    every_namespace: bool = False
    namespaces: frozenset[str] = frozenset()

    @property
    def allows_lookups(self) -> bool:
        """True when the token is good for lookups in some namespace."""
        return self.admin or self.every_namespace or bool(self.namespaces)

    def may_look_up(self, namespace: str) -> bool:
        return self.admin or self.every_namespace or namespace in self.namespaces


class TokenCheck:
    """The configured tokens as digests, and the check of a presented token."""

    def __init__(self, tokens: ServiceTokens):
        self.admin_configured = tokens.admin is not None
        self.lookups_open = tokens.lookups_open
        self._admin = _digest(tokens.admin) if tokens.admin is not None else None
        self._lookup = _digest(tokens.lookup) if tokens.lookup is not None else None
        self._namespaces = [(_digest(token), ns) for ns, token in sorted(tokens.namespaces.items())]

    def grant(self, presented: str | None) -> Grant:
        """What `presented` allows. Every configured token is compared, whether an
        earlier one matched or not, so the time taken says nothing about which did."""
        if not presented:
            return Grant()
        given = _digest(presented)
        admin = self._admin is not None and hmac.compare_digest(given, self._admin)
        router = self._lookup is not None and hmac.compare_digest(given, self._lookup)
        namespaces = frozenset(ns for digest, ns in self._namespaces if hmac.compare_digest(given, digest))
        return Grant(admin=admin, every_namespace=router, namespaces=namespaces)
