"""A rerunnable record of what the leak scenario suite says, to check a refactor for "no behaviour change".

    python benchmarks/scenario_record.py --out before.json          # every scenario (a few minutes)
    python benchmarks/scenario_record.py --only "steady training" --out one.json
    python benchmarks/scenario_record.py --diff before.json after.json   # exit 1 if any record differs

Every scenario of tests/integration/leak_scenarios.py (the leaking and the healthy ones, seed 0) runs
through its ``run_scenario`` at attach() defaults, each in a fresh interpreter (this script with
``--only``): a scenario's host RSS and heap must not depend on the ones before it, as the test suite
does for host leaks. Per scenario the record holds the state changes of the leak-findings file
(kind, series, state, steps, the sentence, culprits and holders), ``Agent.findings()`` at the end,
the WARNING lines of the "gpumemd" logger, and the start and exit lines the agent announces.

What varies between runs of the same code is rewritten to a placeholder, and steps and texts are
kept exactly:

- timestamps (the record's ``time``, the ``run`` id of its writer), pids, the output directory;
- durations and shares in the exit line ("watched in 2.1 s", "agent took 146 ms (7.0% of the run ...)":
  the "; tensor censuses ... of it" clause depends on timing too, so the whole cost part is one
  placeholder);
- the out-of-memory projection ("out of memory in ~1.6 h (~11,716,562 steps)"): the steps come from
  the host's free memory at that moment, the hours from measured step times; ``steps_to_oom`` and
  ``hours_to_oom`` are dropped from the records for the same reason (``severity`` is kept);
- line numbers in leak_scenarios.py inside holder texts become ``<function>+<offset>``, so a moved
  import in that file (a refactor may change test import paths) does not read as a new holder.

Rates are rounded to 4 significant digits (slopes, tensors per step, p values).

Timing- and measurement-dependent (``--diff`` reports these as warnings, not differences):

- The sampling grid, and with it every step number. The agent samples a step end every 10th step
  (``MAX_STRIDE``) once its first samples have measured what a sample costs against a step: strides
  budgeted from measured seconds (and any sample the census component asks for) set the grid's
  phase. Runs of the same code usually sample the same steps (0, 1, 2, 12, 22, ...), but on a loaded
  machine a stride of 9 instead of 10 moves the grid by a step, and with it the evaluations, the
  steps a finding is suspected and confirmed at, its onset (a survivor scan's step), the container
  sizes in the holder text ("list of 252 items") and the growth (seen once in the host-buffer
  scenario: 551/651 instead of 552/652). Each record keeps its ``sampling`` grid (runs of equal
  strides, ``first-last/stride``).
- A count series' statistics at a state change (``p_value``, ``slope_low``, ``slope_high`` of an event
  on ``tensors{...}``, ``graph_nodes{...}`` and the like): its points come from survivor scans, which
  the budget spaces by measured seconds.
- A host RSS finding (the host-buffer scenario, and the DataLoader workers' RSS in the worker-cache
  one). RSS is measured memory and differs by some KiB from
  run to run: in sentences about ``host_rss_bytes`` its rate, 95% bound and growth become ``<rss>``
  (``growth_bytes``, slopes and ``p_value`` stay in the record). The noise can also move the
  evaluation that suspects it by one check (552 or 602 on the same grid), and the heap look that
  names its culprit is budgeted by measured seconds, so other containers may be named after the
  first ("(+2 more groups)").

A scenario whose grids differ, or that has a host or workers' RSS finding, is compared loosely: every number
masked, "(+N more groups)" dropped, culprits after the first ignored; a field that then agrees is a
warning, one that still differs (another kind, series, state, first holder or wording, a missing
finding) is a difference. Every other scenario must agree exactly, field by field.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import itertools
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "integration"))
sys.path.insert(0, ROOT)  # the gpumemd of this tree, whatever else is installed

import gpumemd  # noqa: E402
from gpumemd.records.plain import plain  # noqa: E402

FORMAT = 1
SEED = 0
SIG_DIGITS = 4

_NUMBER = re.compile(r"\d[\d,.]*")

_ROUNDED = ("slope_bytes_per_step", "slope_low", "slope_high", "tensors_per_step", "p_value")
_DROPPED = ("time", "steps_to_oom", "hours_to_oom", "run")  # run: the writer's pid and start time
_OOM = re.compile(r"out of memory in ~(?:[\d.,]+ (?:s|min|h|days)(?: \(~[\d,]+ steps\))?|[\d,]+ steps)")
_EXIT_WALL = re.compile(r"watched in [\d.,]+ (?:ms|s|min|h)")
_EXIT_COST = re.compile(r"agent took [\d.,]+ (?:ms|s|min|h) \([^)]*\)")
_PID = re.compile(r"\bpids? \d+(?:, \d+)*")
_RSS_SERIES = ("host_rss_bytes", "workers_rss_bytes")
_RSS_FIGURES = re.compile(r"(on host_rss_bytes(?: \(phase [^)]*\))?), \+[\d.,]+ \w+/step \(>= [\d.,]+ \w+/step at 95%\)"
                          r"((?:, since step \d+)?), \+[\d.,]+ \w+ so far")
_MORE_GROUPS = re.compile(r" \(\+\d+ more groups?\)")
_LATER_CULPRIT = re.compile(r"\.culprits(?:\.length|\[[1-9]\d*\])")  # a culprit after the first, or their number
_SCENARIO_LINE = re.compile(r"leak_scenarios\.py:(\d+)")


# --- one scenario, in this process ------------------------------------------------------------------


class _Lines(logging.Handler):
    """Keeps what gpumemd logs at WARNING and above, and the status lines (start, exit)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.warnings: list[str] = []
        self.status: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.name == "gpumemd.status":
            self.status.append(record.getMessage())
        elif record.levelno >= logging.WARNING:
            prefix = "" if record.levelno == logging.WARNING else f"{record.levelname}: "
            self.warnings.append(prefix + record.getMessage())


def _function_lines() -> list[tuple[int, int, str]]:
    """(first line, last line, name) of every function in leak_scenarios.py, innermost last."""
    import leak_scenarios

    with open(leak_scenarios.__file__, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    return [(n.lineno, n.end_lineno or n.lineno, n.name) for n in ast.walk(tree)
            if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]


def _relative_lines(text: str, functions: list[tuple[int, int, str]]) -> str:
    def relative(match: re.Match[str]) -> str:
        line = int(match.group(1))
        inside = [(first, name) for first, last, name in functions if first <= line <= last]
        if not inside:
            return match.group(0)
        first, name = max(inside)  # the innermost: the latest start
        return f"leak_scenarios.py:<{name}+{line - first}>"

    return _SCENARIO_LINE.sub(relative, text)


def _text(text: str, output_dir: str, functions: list[tuple[int, int, str]]) -> str:
    text = text.replace(output_dir, "<output_dir>")
    text = _OOM.sub("out of memory in ~<projection>", text)
    text = _RSS_FIGURES.sub(r"\1, +<rss>/step (>= <rss>/step at 95%)\2, +<rss> so far", text)
    text = _EXIT_WALL.sub("watched in <duration>", text)
    text = _EXIT_COST.sub("agent took <cost>", text)
    text = _PID.sub(lambda m: m.group(0).split(" ")[0] + " <pid>", text)
    return _relative_lines(text, functions)


def _round(value: Any) -> Any:
    return float(f"{value:.{SIG_DIGITS}g}") if isinstance(value, float) else value


def _stable(value: Any, output_dir: str, functions: list[tuple[int, int, str]]) -> Any:
    """A finding (or a part of one) with what varies between runs rewritten (module docstring)."""
    if isinstance(value, dict):
        return {k: _round(_stable(v, output_dir, functions)) if k in _ROUNDED else _stable(v, output_dir, functions)
                for k, v in sorted(value.items()) if k not in _DROPPED}
    if isinstance(value, list | tuple):
        return [_stable(v, output_dir, functions) for v in value]
    if isinstance(value, str):
        return _text(value, output_dir, functions)
    return value


def _grid(steps: list[int]) -> str:
    """The sampled steps as runs of equal strides: ``0-2/1, 2-652/10``."""
    if len(steps) < 2:
        return ",".join(map(str, steps))
    runs: list[tuple[int, int, int]] = []  # first, last, stride
    for previous, step in itertools.pairwise(steps):
        stride = step - previous
        if runs and runs[-1][2] == stride and runs[-1][1] == previous:
            runs[-1] = (runs[-1][0], step, stride)
        else:
            runs.append((previous, step, stride))
    return ", ".join(f"{first}-{last}/{stride}" for first, last, stride in runs)


def _with_sampling(scenario: Any, sampled: list[int]) -> Any:
    """The scenario, its loop followed by a look at the steps the agent sampled (before detach)."""
    inner = scenario.run

    def run(steps: int) -> None:
        inner(steps)
        agent = gpumemd.current()
        if agent is not None:
            sampled.extend(r.step for r in agent.steps())

    return dataclasses.replace(scenario, run=run)


def record_scenario(name: str) -> dict[str, Any]:
    """Run one scenario under a fresh agent (``leak_scenarios.run_scenario``) and return its record."""
    import leak_scenarios as ls

    scenario = next((s for s in ls.LEAKS + ls.HEALTHY if s.name == name), None)
    if scenario is None:
        raise SystemExit(f"no scenario named {name!r}; known: {[s.name for s in ls.LEAKS + ls.HEALTHY]}")
    lines = _Lines()
    logger, status = logging.getLogger("gpumemd"), logging.getLogger("gpumemd.status")
    # With a handler in the chain the agent announces through gpumemd.status at INFO (not stderr):
    # let INFO through there so the start and exit lines reach the handler.
    status.setLevel(logging.INFO)
    logger.addHandler(lines)
    output_dir = tempfile.mkdtemp(prefix="scenario-record-")
    try:
        sampled: list[int] = []
        outcome = ls.run_scenario(_with_sampling(scenario, sampled), output_dir, seed=SEED)
    finally:
        logger.removeHandler(lines)
        shutil.rmtree(output_dir, ignore_errors=True)
    functions = _function_lines()
    events = _stable(outcome.events, output_dir, functions)
    return {
        "expected_kind": scenario.kind,
        "seed": SEED,
        "steps": outcome.steps,
        "sampling": _grid(sampled),
        "transitions": [f"{e['kind']} {e['state']} at step {e['updated_step']}" for e in outcome.events],
        "events": events,
        "findings": _stable([plain(f) for f in outcome.findings], output_dir, functions),
        "warnings": _stable(lines.warnings, output_dir, functions),
        "status_lines": _stable(lines.status, output_dir, functions),
    }


# --- the whole suite, one fresh interpreter per scenario -------------------------------------------


def _meta() -> dict[str, str]:
    import torch

    return {"python": sys.version.split()[0], "torch": torch.__version__}


def _record_isolated(name: str) -> dict[str, Any]:
    fd, path = tempfile.mkstemp(prefix="scenario-record-", suffix=".json")
    os.close(fd)
    try:
        subprocess.run([sys.executable, os.path.abspath(__file__), "--only", name, "--out", path],
                       check=True, timeout=900)
        with open(path, encoding="utf-8") as f:
            record: dict[str, Any] = json.load(f)["scenarios"][name]
        return record
    finally:
        os.remove(path)


def record_all() -> dict[str, Any]:
    import leak_scenarios as ls

    scenarios: dict[str, Any] = {}
    for scenario in ls.LEAKS + ls.HEALTHY:
        start = time.perf_counter()
        scenarios[scenario.name] = _record_isolated(scenario.name)
        print(f"{time.perf_counter() - start:6.1f} s  {scenario.name}: "
              f"{'; '.join(scenarios[scenario.name]['transitions']) or 'nothing'}", file=sys.stderr, flush=True)
    return scenarios


def _write(path: str, scenarios: dict[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"format": FORMAT, "meta": _meta(), "scenarios": scenarios}, f, indent=1, ensure_ascii=False)
        f.write("\n")


# --- diff ------------------------------------------------------------------------------------------


def _leaves(value: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """(path, value) of every leaf: ``events[0].culprits[0].holder``; a list's length is a leaf too."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _leaves(item, f"{path}.{key}" if path else key)
    elif isinstance(value, list):
        yield f"{path}.length", len(value)
        for i, item in enumerate(value):
            yield from _leaves(item, f"{path}[{i}]")
    else:
        yield path, value


_MISSING = "<absent>"


def _shown(value: Any) -> str:
    return value if value is _MISSING else json.dumps(value, ensure_ascii=False)


def _masked(value: Any) -> Any:
    """The value with every number masked and "(+N more groups)" dropped: what must agree in a loose
    comparison."""
    if isinstance(value, bool) or value == _MISSING:
        return value
    if value is None or isinstance(value, int | float):  # None: an unbounded slope interval's side (±inf)
        return "#"
    return _NUMBER.sub("#", _MORE_GROUPS.sub("", value)) if isinstance(value, str) else value


def _rss_driven(record: dict[str, Any]) -> bool:
    """A scenario with a host RSS finding: measured RSS decides its steps and extra groups (docstring)."""
    return any(e.get("series") in _RSS_SERIES for e in record.get("events", []))


_SCAN_TIMED = re.compile(r"^events\[(\d+)\]\.(?:p_value|slope_low|slope_high)$")
_SPARSE = ("tensors{", "graph_nodes{", "growing_tensor_bytes{", "long_lived_bytes{")


def _scan_timed(path: str, record: dict[str, Any]) -> bool:
    """A count series' statistics at a state change: its points come from survivor scans, which the
    budget spaces by measured seconds (the sampling grid does not show it), so two runs of the same code
    judge the same growth on other points (a suspected event's p-value 1.3e-4 or 1.4e-12, its lower bound
    from a lent verdict or its own window)."""
    found = _SCAN_TIMED.match(path)
    events = record.get("events", [])
    index = int(found.group(1)) if found is not None else -1
    return 0 <= index < len(events) and str(events[index].get("series", "")).startswith(_SPARSE)


def _timing(path: str, va: Any, vb: Any, loose: bool) -> bool:
    if path == "sampling":
        return True
    if _LATER_CULPRIT.search(path) is not None:
        return loose
    # How many state changes, findings and lines: never loose (a missing finding is a difference).
    return loose and not path.endswith(".length") and _masked(va) == _masked(vb)


def _diff_scenario(name: str, a: dict[str, Any], b: dict[str, Any]) -> tuple[list[str], list[str]]:
    differences: list[str] = []
    warnings: list[str] = []
    # Another grid moves every step number, and RSS noise moves a host finding (module docstring):
    # then only the kinds, states, first culprits and wording must agree, numbers masked.
    loose = a.get("sampling") != b.get("sampling") or _rss_driven(a) or _rss_driven(b)
    leaves_a, leaves_b = dict(_leaves(a)), dict(_leaves(b))
    for path in list(leaves_a) + [p for p in leaves_b if p not in leaves_a]:
        va, vb = leaves_a.get(path, _MISSING), leaves_b.get(path, _MISSING)
        if va == vb:
            continue
        line = f"{name}: {path}:\n    A: {_shown(va)}\n    B: {_shown(vb)}"
        timing = _timing(path, va, vb, loose) or (_scan_timed(path, a) and _scan_timed(path, b))
        (warnings if timing else differences).append(line)
    return differences, warnings


def diff_records(a: dict[str, Any], b: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(differences, timing-dependent warnings) between two record files, one line per field."""
    differences: list[str] = []
    warnings: list[str] = []
    scenarios_a, scenarios_b = a["scenarios"], b["scenarios"]
    for name in list(scenarios_a) + [n for n in scenarios_b if n not in scenarios_a]:
        if name not in scenarios_a or name not in scenarios_b:
            differences.append(f"{name}: only in {'A' if name in scenarios_a else 'B'}")
            continue
        found, timing = _diff_scenario(name, scenarios_a[name], scenarios_b[name])
        differences += found
        warnings += timing
    return differences, warnings


def _diff_files(path_a: str, path_b: str) -> int:
    with open(path_a, encoding="utf-8") as f:
        a = json.load(f)
    with open(path_b, encoding="utf-8") as f:
        b = json.load(f)
    if a.get("meta") != b.get("meta"):
        print(f"note: recorded under different environments: {a.get('meta')} vs {b.get('meta')}")
    differences, warnings = diff_records(a, b)
    for line in warnings:
        print("warning (timing-dependent): " + line)
    for line in differences:
        print("DIFFERENT: " + line)
    names = sorted({line.split(":", 1)[0] for line in differences})
    print(f"{len(differences)} field(s) differ in {len(names)} scenario(s)"
          + (": " + "; ".join(names) if names else "") + f"; {len(warnings)} timing-dependent warning(s)")
    return 1 if differences else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="the JSON record to write")
    parser.add_argument("--only", metavar="NAME", help="run only this scenario (in this process)")
    parser.add_argument("--diff", nargs=2, metavar=("A", "B"), help="compare two records; exit 1 if they differ")
    args = parser.parse_args()
    if args.diff:
        raise SystemExit(_diff_files(*args.diff))
    if not args.out:
        parser.error("--out is required unless --diff")
    scenarios = {args.only: record_scenario(args.only)} if args.only else record_all()
    _write(args.out, scenarios)


if __name__ == "__main__":
    main()
