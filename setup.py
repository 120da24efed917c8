"""Build step for the wheel: copy the Grafana and Prometheus files into ``gpumemd/_artifacts/``.

All metadata is in pyproject.toml. The files themselves stay where they are kept and edited
(``grafana/``, ``exporters/`` at the repository root); ``gpumemd/artifacts.py`` lists them, and this
copies exactly that list into the built package, so ``pip install gpumemd`` can ``gpumemd export`` them.
Editable installs copy nothing: they read the files from the checkout. A listed file that is missing
fails the build instead of producing a wheel without it.
"""

from __future__ import annotations

import importlib.util
import os
import sys

from setuptools import setup
from setuptools.command.build_py import build_py


def _artifact_sources() -> list[str]:
    # By path, not `import gpumemd`: building must not import the package (or torch).
    spec = importlib.util.spec_from_file_location("_gpumemd_artifacts", os.path.join("gpumemd", "artifacts.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return list(module.source_paths())


class build_py_with_artifacts(build_py):
    def _artifact_pairs(self) -> list[tuple[str, str]]:
        target = os.path.join(self.build_lib, "gpumemd", "_artifacts")
        return [(src, os.path.join(target, *src.split("/"))) for src in _artifact_sources()]

    def run(self) -> None:
        super().run()
        if self.editable_mode:
            return
        for src, dst in self._artifact_pairs():
            self.mkpath(os.path.dirname(dst))
            self.copy_file(src, dst, preserve_mode=True)

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        outputs = list(super().get_outputs(include_bytecode))
        if not self.editable_mode:
            outputs += [dst for _, dst in self._artifact_pairs()]
        return outputs


setup(cmdclass={"build_py": build_py_with_artifacts})
