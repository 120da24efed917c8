from __future__ import annotations

import subprocess
import sys


def test_import_gpumemd_loads_no_heavy_dependency() -> None:
    code = (
        "import sys, gpumemd, gpumemd.cli; "
        "heavy = [m for m in ('torch', 'pynvml', 'prometheus_client', 'psutil') if m in sys.modules]; "
        "print(','.join(heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_cli_help_loads_no_torch() -> None:
    code = (
        "import sys\nfrom gpumemd.cli import main\n"
        "rc = main(['--help'])\nassert 'torch' not in sys.modules, 'torch imported by --help'\nsys.exit(rc)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "demo" in out.stdout
