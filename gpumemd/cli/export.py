"""``gpumemd export grafana|prometheus|all DIR [--force]``: write the shipped dashboard, rules and configs.

``grafana``: ``dashboards/gpumemd.json`` and ``provisioning/{dashboards,datasources}/gpumemd.yaml``.
``prometheus``: ``rules/gpumemd.rules.yml`` and its promtool tests, the static and file_sd scrape configs,
a file_sd target example and writer, the Kubernetes PodMonitor and the Slurm file_sd helper.
``all``: both, into ``DIR/grafana`` and ``DIR/prometheus``. The layout is the one the files refer to
(``rule_files: rules/...``, ``file_sd/*.json``), so the directory works as it is.

An existing file is never overwritten without ``--force``: nothing is written then, and one line names
the file. Each file is written whole (temp file + rename).
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from gpumemd import artifacts
from gpumemd.cli.errors import CliError
from gpumemd.files import replace_file

_CHOICES = ("grafana", "prometheus", "all")


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "export",
        help="write the Grafana dashboard or the Prometheus rules and scrape configs into a directory",
        description=(
            "Write the files shipped with gpumemd: 'grafana' (dashboard JSON and provisioning YAML), "
            "'prometheus' (recording and alert rules with their promtool tests, scrape configs, file_sd "
            "example, Kubernetes PodMonitor, Slurm file_sd helper) or 'all' (into DIR/grafana and DIR/prometheus)."
        ),
    )
    p.add_argument("what", choices=_CHOICES, help="which files to write")
    p.add_argument("dir", metavar="DIR", help="directory to write into (created if missing)")
    p.add_argument("--force", action="store_true", help="overwrite files that already exist")
    p.set_defaults(func=run)


def _next_steps(kind: str, directory: str) -> str:
    if kind == "prometheus":
        rules = os.path.join(directory, "rules", "gpumemd.rules.yml")
        tests = " ".join(os.path.join(directory, "rules", name)
                         for name in ("gpumemd.rules.test.yml", "gpumemd.rules.runs.test.yml"))
        return (f"next: promtool check rules {rules} && promtool test rules {tests}; then list {rules} under "
                f"rule_files in your Prometheus configuration ({os.path.join(directory, 'prometheus.yml')} "
                "is a complete example)")
    dashboards = os.path.join(os.path.abspath(directory), "dashboards")
    return (f"next: copy {os.path.join(directory, 'provisioning')}/ into Grafana's provisioning directory "
            f"(/etc/grafana/provisioning/) and set options.path in dashboards/gpumemd.yaml to {dashboards} "
            "(or copy the dashboard to /var/lib/grafana/dashboards/gpumemd/)")


def run(args: argparse.Namespace) -> int:
    kinds = artifacts.KINDS if args.what == "all" else (args.what,)
    directory: str = args.dir
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise CliError(f"{directory} exists and is not a directory")
    bases = {kind: os.path.join(directory, kind) if args.what == "all" else directory for kind in kinds}
    plan: list[tuple[str, str, bytes, int]] = []  # (kind, path, data, mode)
    for kind, base in bases.items():
        try:
            files = artifacts.read(kind)
        except OSError as err:  # ArtifactsNotFound included: a broken install
            raise CliError(str(err)) from None
        for artifact, data in files:
            path = os.path.join(base, *artifact.target.split("/"))
            plan.append((kind, path, data, 0o755 if artifact.executable else 0o644))

    existing = [path for _, path, _, _ in plan if os.path.lexists(path)]
    for path in existing:
        if os.path.isdir(path):
            raise CliError(f"{path} is a directory; remove it or export somewhere else")
    if existing and not args.force:
        more = f" (and {len(existing) - 1} more)" if len(existing) > 1 else ""
        raise CliError(f"{existing[0]} already exists{more}; nothing written (use --force to overwrite)")

    for _, path, data, mode in plan:
        try:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            replace_file(path, data, mode)
        except OSError as err:
            raise CliError(f"cannot write {path}: {err.strerror or err}") from None
        print(f"wrote {path}")
    for kind, base in bases.items():
        print(_next_steps(kind, base))
    return 0
