"""End-to-end fixtures: a real Prometheus, stopped even when the test fails.

Without the ``prometheus`` binary the e2e tests skip, except where ``GPUMEMD_REQUIRE_PROMETHEUS=1``
(CI installs Debian's package and sets it), where a missing binary fails them.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from prom_binaries import require_binary
from prometheus_server import Prometheus


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[Prometheus]:
    server = Prometheus(require_binary("prometheus"), tmp_path)
    try:
        yield server
    finally:
        server.stop()
