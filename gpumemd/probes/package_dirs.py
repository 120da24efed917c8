"""Where the code that is never "the user's line" lives: torch's package, gpumemd's, the stdlib.

Allocation sites name the first frame of a stack that is the user's. Deciding that by substrings
("/torch/" in the path) hid user code in any folder of those names, this repository's own checkout
on a CI runner included; the real directories, as Python records them in ``co_filename`` (absolute,
and resolved where symlinks differ), are exact.
"""

from __future__ import annotations

import functools
import os
import sysconfig

_PACKAGE_DIR = os.path.dirname(os.path.dirname(__file__))  # gpumemd/probes/package_dirs.py -> gpumemd/

@functools.cache
def internal_dirs() -> tuple[str, ...]:
    """Directory prefixes, ``/``-separated and ending in ``/``."""
    import torch  # here, not at the top: `import gpumemd` stays free of torch

    # gpumemd's own directory from this file's place in it: importing the package here would close
    # a circle (gpumemd -> api -> components -> this module -> gpumemd)
    roots = [os.path.dirname(torch.__file__), _PACKAGE_DIR]
    paths = sysconfig.get_paths()
    roots += [paths[k] for k in ("stdlib", "platstdlib") if paths.get(k)]
    out: list[str] = []
    for root in roots:
        for variant in (os.path.abspath(root), os.path.realpath(root)):
            prefix = variant.replace("\\", "/").rstrip("/") + "/"
            if prefix not in out:
                out.append(prefix)
    return tuple(out)
