"""Where the code that is never "the user's line" lives, in two tiers.

- **Internal**: torch's package and gpumemd's, and torch.compile's generated code (Inductor's cache
  directory). An allocation site is the first frame outside these: in a venv, a conda env or a
  ``python:3.x`` image, a Hugging Face or Lightning frame is where the allocation happened, and
  hiding it would collapse every site onto ``trainer.train()``.
- **Library**: the standard library and every installed package (``site-packages``,
  ``dist-packages``). The first frame outside both tiers is the user's own file; a site shows it
  too when it is not the first frame outside torch.

Deciding that by substrings ("/torch/" in the path) hid user code in any folder of those names, this
repository's own checkout on a CI runner included; the real directories, as Python records them in
``co_filename`` (absolute, and resolved where symlinks differ), are exact.
"""

from __future__ import annotations

import contextlib
import functools
import getpass
import os
import site
import sysconfig
import tempfile

# gpumemd/probes/holding/package_dirs.py -> gpumemd/: three levels up (moving this file changes the count)
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))


def _prefixes(roots: list[str]) -> tuple[str, ...]:
    out: list[str] = []
    for root in roots:
        for variant in (os.path.abspath(root), os.path.realpath(root)):
            prefix = variant.replace("\\", "/").rstrip("/") + "/"
            if prefix not in out:
                out.append(prefix)
    return tuple(out)


def _inductor_cache_dir() -> str:
    """Inductor's default cache (``torch._inductor.runtime.cache_dir_utils.default_cache_dir``)."""
    configured = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if configured:
        return configured
    try:
        user = getpass.getuser()
    except Exception:  # noqa: BLE001 - no passwd entry (a container's arbitrary uid): torch uses "unknown"
        user = "unknown"
    return os.path.join(tempfile.gettempdir(), "torchinductor_" + user.replace(os.sep, "_"))


@functools.cache
def internal_dirs() -> tuple[str, ...]:
    """Torch's, gpumemd's and Inductor's directory prefixes, ``/``-separated and ending in ``/``."""
    import torch  # here, not at the top: `import gpumemd` stays free of torch

    # gpumemd's own directory from this file's place in it: importing the package here would close
    # a circle (gpumemd -> api -> components -> this module -> gpumemd)
    return _prefixes([os.path.dirname(torch.__file__), _PACKAGE_DIR, _inductor_cache_dir()])


@functools.cache
def library_dirs() -> tuple[str, ...]:
    """The standard library's and the installed packages' directory prefixes."""
    paths = sysconfig.get_paths()
    roots = [paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if paths.get(k)]
    with contextlib.suppress(Exception):  # a virtualenv's old site.py lacks them: sysconfig's paths remain
        roots += [*site.getsitepackages(), site.getusersitepackages()]
    return _prefixes(roots)


def not_user_dirs() -> tuple[str, ...]:
    """Both tiers: where no module of the job's own code lives."""
    return internal_dirs() + library_dirs()
