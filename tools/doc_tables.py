"""Regenerate the README's generated tables (configuration, metric reference) in place.

Usage: python tools/readme_tables.py [--check]

The tables are generated from the code (``Config`` field docstrings, ``gpumemd.exporter.metrics``)
so they cannot drift; ``--check`` exits 1 when the README is out of date (the test suite runs it).
"""

from __future__ import annotations

import dataclasses
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def config_table() -> str:
    from gpumemd.config import Config, field_docs

    rows = ["| option | environment variable | default | meaning |", "|---|---|---|---|"]
    defaults = Config()
    for f in dataclasses.fields(Config):
        rows.append(f"| `{f.name}` | `GPUMEMD_{f.name.upper()}` | `{getattr(defaults, f.name)!r}` "
                    f"| {field_docs()[f.name]} |")
    return "\n".join(rows)


def metric_table() -> str:
    from gpumemd.exporter.metrics import reference_table

    return reference_table().rstrip("\n")


def render(text: str) -> str:
    for name, table in (("config-table", config_table()), ("metric-table", metric_table())):
        pattern = re.compile(rf"(<!-- {name}:start -->\n).*?(<!-- {name}:end -->)", re.S)
        if not pattern.search(text):
            raise SystemExit(f"README.md has no <!-- {name}:start --> ... <!-- {name}:end --> markers")
        text = pattern.sub(lambda m, table=table: m.group(1) + table + "\n" + m.group(2), text)
    return text


def main(argv: list[str]) -> int:
    path = ROOT / "README.md"
    current = path.read_text(encoding="utf-8")
    wanted = render(current)
    if "--check" in argv:
        if wanted != current:
            print("README.md tables are out of date: run python tools/readme_tables.py", file=sys.stderr)
            return 1
        return 0
    tmp = path.with_suffix(".md.tmp")
    tmp.write_text(wanted, encoding="utf-8")
    tmp.replace(path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
