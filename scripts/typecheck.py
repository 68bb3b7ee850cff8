"""mypy over tiercache/, tiers/ and connector/ under the names they import as.

tiers/ and connector/ import as tiercache.tiers and tiercache.connector (pyproject's
package-dir mapping). mypy cannot follow that mapping: the editable install maps them
with an import hook, which mypy does not run, and given the folders it would name their
modules `tiers.*` and `connector.*`, so every `import tiercache.tiers...` would be
unresolved. This runs mypy with its own command line (pyproject's [tool.mypy] and any
arguments given here), each source renamed the way setuptools maps it.

    .venv/bin/python scripts/typecheck.py            # the three packages
    .venv/bin/python scripts/typecheck.py tiers/     # or some of them
"""

from __future__ import annotations

import os
import sys
import time

from mypy import util
from mypy.fscache import FileSystemCache
from mypy.main import process_options, run_build

# Folder (as mypy names its modules from the path) -> the package it imports as.
PACKAGE_DIR = {"tiers": "tiercache.tiers", "connector": "tiercache.connector"}
DEFAULT_TARGETS = ["tiercache", "tiers", "connector"]


def _runtime_name(module: str) -> str:
    top, dot, rest = module.partition(".")
    return PACKAGE_DIR[top] + dot + rest if top in PACKAGE_DIR else module


def _is_target(arg: str) -> bool:
    """A Python file or a package folder (an option's value, such as a cache folder, is neither)."""
    return arg.endswith(".py") and os.path.isfile(arg) or os.path.isfile(os.path.join(arg, "__init__.py"))


def main() -> None:
    started = time.time()
    args = sys.argv[1:]
    if not any(_is_target(arg) for arg in args):
        args = [*args, *DEFAULT_TARGETS]
    fscache = FileSystemCache()
    sources, options = process_options(args, fscache=fscache)
    for source in sources:
        source.module = _runtime_name(source.module)
    # What mypy.main.main does after process_options (mypy is compiled, so its main
    # cannot be handed renamed sources any other way).
    _, messages, blockers = run_build(sources, options, fscache, started, sys.stdout, sys.stderr)
    n_errors, n_notes, n_files = util.count_stats(messages)
    formatter = util.FancyFormatter(sys.stdout, sys.stderr, options.hide_error_codes)
    if options.error_summary:
        if n_errors:
            print(formatter.format_error(n_errors, n_files, len(sources), blockers=blockers))
        elif n_notes == len(messages):
            print(formatter.format_success(len(sources)))
    sys.exit((2 if blockers else 1) if n_notes < len(messages) else 0)


if __name__ == "__main__":
    main()
