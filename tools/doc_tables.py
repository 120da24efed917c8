"""Regenerate the generated tables in docs/ (configuration, metric reference) in place.

Usage: python tools/doc_tables.py [--check]

The tables are generated from the code (``Config`` field docstrings, ``gpumemd.exporter.metrics``)
so they cannot drift; ``--check`` exits 1 when a page is out of date (the test suite runs it).
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


def renamed_table() -> str:
    from gpumemd.cli.run import option_name
    from gpumemd.config_renamed import RENAMED

    rows = ["| old name | name now | old variable | variable now | old `gpumemd run` option |", "|---|---|---|---|---|"]
    for old, new in RENAMED.items():
        rows.append(f"| `{old}` | `{new}` | `GPUMEMD_{old.upper()}` | `GPUMEMD_{new.upper()}` | `{option_name(old)}` |")
    return "\n".join(rows)


def metric_table() -> str:
    from gpumemd.exporter.metrics import reference_table

    return reference_table().rstrip("\n")


# table -> the page that holds it between <!-- name:start --> and <!-- name:end --> markers
PAGES = {"config-table": "docs/configuration.md", "renamed-table": "docs/configuration.md",
         "metric-table": "docs/prometheus-grafana.md"}
TABLES = {"config-table": config_table, "renamed-table": renamed_table, "metric-table": metric_table}


def render(name: str, text: str) -> str:
    table = TABLES[name]()
    pattern = re.compile(rf"(<!-- {name}:start -->\n).*?(<!-- {name}:end -->)", re.S)
    if not pattern.search(text):
        raise SystemExit(f"{PAGES[name]} has no <!-- {name}:start --> ... <!-- {name}:end --> markers")
    return pattern.sub(lambda m: m.group(1) + table + "\n" + m.group(2), text)


def main(argv: list[str]) -> int:
    stale = []
    for name, page in PAGES.items():
        path = ROOT / page
        current = path.read_text(encoding="utf-8")
        wanted = render(name, current)
        if wanted == current:
            continue
        if "--check" in argv:
            stale.append(page)
            continue
        tmp = path.with_suffix(".md.tmp")
        tmp.write_text(wanted, encoding="utf-8")
        tmp.replace(path)
    if stale:
        print(f"out of date: {', '.join(stale)}: run python tools/doc_tables.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
