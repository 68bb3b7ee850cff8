"""Where the peer tier's tests run: nixl-cu12 is a dependency wherever PyPI has a wheel
of it (Linux on x86_64 or aarch64), so there a missing or broken NIXL fails them
rather than skipping them; elsewhere they are skipped, as the tier is off there."""

from __future__ import annotations

import platform
import sys

import pytest

NIXL_PLATFORM = sys.platform == "linux" and platform.machine() in ("x86_64", "aarch64")

needs_nixl = pytest.mark.skipif(not NIXL_PLATFORM, reason="nixl-cu12 has no wheel for this platform")
