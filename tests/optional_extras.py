"""Importing what the ``frameworks`` extra installs, for the tests that drive Lightning or Transformers.

Without the extra those tests skip with the install command, except where
``GPUMEMD_REQUIRE_FRAMEWORKS=1`` (CI installs ``.[test,frameworks]`` and sets it): there a missing
framework fails, so a broken install can never turn the framework tests into silent skips.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest


def require_framework(module: str) -> ModuleType:
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        if os.environ.get("GPUMEMD_REQUIRE_FRAMEWORKS"):
            pytest.fail(f"GPUMEMD_REQUIRE_FRAMEWORKS is set but `{module}` cannot be imported ({exc}); "
                        "pip install -e '.[test,frameworks]'")
        pytest.skip(f"`{module}` not installed: pip install -e '.[test,frameworks]' "
                    "(CI sets GPUMEMD_REQUIRE_FRAMEWORKS=1)")
