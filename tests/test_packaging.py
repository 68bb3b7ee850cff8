"""One distribution: tiers/ and connector/ import as tiercache.tiers and
tiercache.connector from the editable install and from a built wheel, and nothing
installs a top-level `tiers` or `connector`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SOURCES = {"tiercache": "tiercache", "tiers": "tiercache/tiers", "connector": "tiercache/connector"}
# What `tiercache demo` and `tiercache bench` import from the package's local stack.
LOCAL_STACK = (
    "tiercache/ops/local_stack.py",
    "tiercache/ops/tiny_model.py",
    "tiercache/ops/vllm_runner.py",
)

_PROBE = """
import importlib, importlib.util, json, sys
import tiercache, tiercache.tiers.disk.tier, tiercache.tiers.s3.tier
full = sys.argv[1] == "full"
if full:  # runs connector/__init__.py, which imports vLLM: slow, so only once
    connector = importlib.import_module("tiercache.connector")
    connector_file = connector.__file__
else:
    connector_file = importlib.util.find_spec("tiercache.connector").origin
print(json.dumps({
    "tiercache": tiercache.__file__,
    "disk": tiercache.tiers.disk.tier.__file__,
    "connector": connector_file,
    "has_connector_class": hasattr(connector, "TierCacheConnector") if full else None,
    "top_level_tiers": importlib.util.find_spec("tiers") is not None,
    "top_level_connector": importlib.util.find_spec("connector") is not None,
}))
"""


def _probe(cwd: Path, extra_env: dict[str, str] | None = None, full: bool = False) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(extra_env or {})
    result = subprocess.run(
        [sys.executable, "-c", _PROBE, "full" if full else "light"],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def _source_files() -> set[str]:
    """Every module of the source folders, named as it must appear in the wheel."""
    names = set()
    for folder, package in SOURCES.items():
        for path in (REPO / folder).rglob("*.py"):
            if "__pycache__" not in path.parts:
                names.add(f"{package}/{path.relative_to(REPO / folder).as_posix()}")
    return names


def test_editable_install_maps_the_subpackages(tmp_path):
    found = _probe(tmp_path, full=True)  # not the repo root: no accidental import from the cwd
    assert Path(found["tiercache"]).parent == REPO / "tiercache"
    assert Path(found["disk"]).parent == REPO / "tiers" / "disk"
    assert Path(found["connector"]).parent == REPO / "connector"
    assert found["has_connector_class"]
    assert not found["top_level_tiers"] and not found["top_level_connector"]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """Build the wheel from a copy of the sources, so the shared tree gains no build/."""
    work = tmp_path_factory.mktemp("build")
    src = work / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    for folder in SOURCES:
        shutil.copytree(REPO / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    out = work / "dist"
    build = subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--skip-dependency-check"]
        + ["--outdir", str(out)],
        cwd=src,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    (wheel_path,) = out.glob("tiercache-*.whl")
    return wheel_path


def test_wheel_contents(wheel):
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        dist_info = next(n.split("/")[0] for n in names if n.split("/")[0].endswith(".dist-info"))
        top_level = archive.read(f"{dist_info}/top_level.txt").decode().split()
        entry_points = archive.read(f"{dist_info}/entry_points.txt").decode()
    modules = {n for n in names if n.endswith(".py")}
    # One subpackage per concern (docs/architecture.md).
    for package in ("index", "ops", "ops/service", "tiers/disk", "tiers/s3", "connector"):
        assert f"tiercache/{package}/__init__.py" in modules, package
    assert {"tiercache/tiers/disk/tier.py", "tiercache/tiers/s3/tier.py"} <= modules
    missing = _source_files() - modules
    assert not missing, f"source modules left out of the wheel: {sorted(missing)}"
    # `tiercache demo` and `tiercache bench` start a local stack from the wheel alone;
    # helpers only tests use (tests/support/) stay out of it.
    assert set(LOCAL_STACK) <= modules
    assert not any(n.startswith("tiercache/testing/") or "/support/" in n for n in names)
    roots = {n.split("/")[0] for n in names}
    assert roots == {"tiercache", dist_info}
    assert not any(n.startswith(("tiers/", "connector/")) for n in names)
    assert top_level == ["tiercache"]
    assert "tiercache = tiercache.ops.cli:main" in entry_points


def test_wheel_installs_and_imports(wheel, tmp_path):
    target = tmp_path / "site"
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--quiet"]
        + ["--target", str(target), str(wheel)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert install.returncode == 0, install.stderr
    assert not (target / "tiers").exists() and not (target / "connector").exists()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    found = _probe(elsewhere, {"PYTHONPATH": str(target)})
    # PYTHONPATH comes before the editable finder: these are the wheel's files.
    assert Path(found["tiercache"]).is_relative_to(target)
    assert Path(found["disk"]) == target / "tiercache" / "tiers" / "disk" / "tier.py"
    assert Path(found["connector"]) == target / "tiercache" / "connector" / "__init__.py"
    assert not found["top_level_tiers"] and not found["top_level_connector"]
