"""Finding Debian's ``prometheus`` / ``promtool`` for the tests that need them.

Without the binary those tests skip with the install command, except where
``GPUMEMD_REQUIRE_PROMETHEUS=1`` (CI installs the package and sets it): there a missing binary fails.
"""

from __future__ import annotations

import os
import shutil

import pytest


def require_binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        if os.environ.get("GPUMEMD_REQUIRE_PROMETHEUS"):
            pytest.fail(f"GPUMEMD_REQUIRE_PROMETHEUS is set but `{name}` is not on PATH (apt-get install prometheus)")
        pytest.skip(f"`{name}` not installed (apt-get install -y prometheus); CI sets GPUMEMD_REQUIRE_PROMETHEUS=1")
    return path
