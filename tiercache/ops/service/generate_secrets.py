"""Generate the secrets of a docker compose stack once, into two folders (two volumes):
one for the tiercache service, one for vLLM, so that neither gets what it does not use.

    python -m tiercache.ops.service.generate_secrets SERVICE_DIR VLLM_DIR [--owner UID:GID]

Both folders get `s3-credentials` (an AWS shared-credentials file, for
AWS_SHARED_CREDENTIALS_FILE) and `s3-secret-key` (the same secret key alone, for the
job that creates the object-store user): the service's user is `tiercache-gc`, vLLM's
`tiercache-vllm`. vLLM's folder also gets `integrity-key` (the service and its GC never
read pages, so they need no key); the service's gets `admin-token` and `lookup-token`.

A secret already on disk is kept, so restarting the stack changes nothing; a value set
in the environment (TIERCACHE_INTEGRITY_KEY, TIERCACHE_ADMIN_TOKEN,
TIERCACHE_LOOKUP_TOKEN) is written over it. Files are 0400 and folders 0700, owned by
--owner (the uid the stack's containers run as) when given. Nothing is printed but the
file names."""

from __future__ import annotations

import argparse
import os
import secrets
from collections.abc import Mapping
from pathlib import Path

INTEGRITY_KEY = "integrity-key"
ADMIN_TOKEN = "admin-token"
LOOKUP_TOKEN = "lookup-token"
S3_CREDENTIALS = "s3-credentials"
S3_SECRET_KEY = "s3-secret-key"
S3_USERS = {"service": "tiercache-gc", "vllm": "tiercache-vllm"}
# Environment variables whose value, when set, is written instead of a generated one.
FROM_ENVIRONMENT = {
    INTEGRITY_KEY: "TIERCACHE_INTEGRITY_KEY",
    ADMIN_TOKEN: "TIERCACHE_ADMIN_TOKEN",
    LOOKUP_TOKEN: "TIERCACHE_LOOKUP_TOKEN",
}


def _random() -> str:
    # 48 random bytes: 64 URL-safe characters, over integrity_key's 32-character minimum.
    return secrets.token_urlsafe(48)


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip() or None
    except FileNotFoundError:
        return None


class SecretFolder:
    def __init__(self, path: Path, owner: tuple[int, int] | None):
        self.path = path
        self.owner = owner
        path.mkdir(parents=True, exist_ok=True)
        path.chmod(0o700)
        if owner is not None:
            os.chown(path, *owner)

    def write(self, name: str, value: str) -> None:
        target = self.path / name
        if _read(target) == value.strip():
            return
        staged = self.path / f".{name}.tmp"
        staged.unlink(missing_ok=True)
        fd = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
        with os.fdopen(fd, "w") as file:
            file.write(value)
        if self.owner is not None:
            os.chown(staged, *self.owner)
        os.replace(staged, target)
        print(f"wrote {target}")


def _value(name: str, folders: list[SecretFolder], environ: Mapping[str, str]) -> str:
    """The environment's value, else the one already on disk in any folder, else new."""
    given = environ.get(FROM_ENVIRONMENT.get(name, ""), "").strip()
    if given:
        return given
    for folder in folders:
        existing = _read(folder.path / name)
        if existing:
            return existing
    return _random()


def generate(
    service_dir: Path,
    vllm_dir: Path,
    owner: tuple[int, int] | None = None,
    environ: Mapping[str, str] | None = None,
) -> None:
    environ = os.environ if environ is None else environ
    folders = {"service": SecretFolder(service_dir, owner), "vllm": SecretFolder(vllm_dir, owner)}
    folders["vllm"].write(INTEGRITY_KEY, _value(INTEGRITY_KEY, [folders["vllm"]], environ) + "\n")
    for role, folder in folders.items():
        secret_key = _value(S3_SECRET_KEY, [folder], environ)
        folder.write(S3_SECRET_KEY, secret_key + "\n")
        folder.write(
            S3_CREDENTIALS,
            f"[default]\naws_access_key_id = {S3_USERS[role]}\naws_secret_access_key = {secret_key}\n",
        )
    for name in (ADMIN_TOKEN, LOOKUP_TOKEN):
        folders["service"].write(name, _value(name, [folders["service"]], environ) + "\n")


def _owner(text: str) -> tuple[int, int]:
    uid, _, gid = text.partition(":")
    try:
        return int(uid), int(gid or uid)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--owner must be UID:GID, got {text!r}") from None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("service_dir", type=Path)
    parser.add_argument("vllm_dir", type=Path)
    parser.add_argument("--owner", type=_owner, default=None, help="UID:GID to own the files")
    args = parser.parse_args(argv)
    generate(args.service_dir, args.vllm_dir, args.owner)


if __name__ == "__main__":
    main()
