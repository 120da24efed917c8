"""The job's exceptions come out of gpumemd exactly as ``python script.py`` shows them.

Each script raises one kind of exception (or exits) two calls deep from top level. It runs as
``python script.py`` (the baseline), then with gpumemd: ``gpumemd run script.py``; ``gpumemd.attach()``
and ``with gpumemd.oom_guard():`` in the script; both, once (an OOM: the guard and the excepthook
could both act); the decorator form, once. Every way must give the baseline's exit status (death by
SIGINT included), its stdout, and its stderr byte for byte once gpumemd's own lines (``gpumemd: ...``:
start line, exit summary, "report written") are taken out: the same exception type and message, the
same frames, no frame of gpumemd or runpy.

It is the same file for every run: ``TRANSPARENCY_GUARD`` makes it attach and use ``gpumemd.oom_guard``
where it otherwise uses ``contextlib.nullcontext`` and an identity decorator, so line numbers match.
All runs start at once on a small pool. A run that imports torch costs ~3 s of CPU, so the kinds that
only ``gpumemd run`` handles itself (an exit object, a SyntaxError, the recursion depth) run only there.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # ~30 interpreters that import torch

PRELUDE = """\
import contextlib
import os
import sys
{top}
guard, decorate = contextlib.nullcontext, lambda function: function  # plain python: no gpumemd
if os.environ.get("TRANSPARENCY_GUARD"):
    import gpumemd

    gpumemd.attach()  # output_dir from GPUMEMD_OUTPUT_DIR, everything else default
    if os.environ["TRANSPARENCY_GUARD"] == "with":
        guard = gpumemd.oom_guard
    else:
        decorate = gpumemd.oom_guard()
"""

# The frames: <module> -> outer -> middle -> fail (plus those the kind adds).
FRAMES = """

def outer():
    print("stdout before the failure")
    middle(7)


@decorate
def middle(step):
    fail(step)


with guard():
    outer()
"""

RUN, GUARD, BOTH, DECORATOR = "gpumemd run", "oom_guard", "gpumemd run + oom_guard", "@oom_guard()"
DEFAULT_RUNNERS = (RUN, GUARD)


def _cuda_oom_text(digits: int) -> str:
    n = "9" * digits
    return (f"CUDA out of memory. Tried to allocate {n}.00 GiB. GPU 0 has a total capacity of {n}.00 GiB of "
            f"which {n}.00 MiB is free. Process 4242 has {n}.00 GiB memory in use. Of the allocated memory "
            f"{n}.00 GiB is allocated by PyTorch, and {n}.00 MiB is reserved by PyTorch but unallocated. If "
            "reserved but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "
            "to avoid fragmentation.  See documentation for Memory Management  "
            "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)")


CPU_OOM_TEXT = ("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: you tried "
                "to allocate 1099511627776 bytes. Error code 12 (Cannot allocate memory)")


@dataclass(frozen=True)
class Kind:
    body: str  # defines fail(step), and whatever it needs first
    returncode: int  # what python gives (checked: the script does what its name says)
    last_line: str | None  # the last line python writes to stderr; None: it writes nothing
    traceback: bool = True  # python prints a traceback through outer, middle and fail
    stdout: str = "stdout before the failure\n"
    oom: bool = False  # gpumemd takes it for an OOM: one report under an agent
    top: str = ""  # runs before gpumemd attaches
    runners: tuple[str, ...] = DEFAULT_RUNNERS
    xfail: dict[str, str] = field(default_factory=dict)  # runner -> why its stderr cannot match
    skip: str | None = None  # why this Python cannot run this kind


KINDS: dict[str, Kind] = {
    "custom exception": Kind(
        """
class TrainingDiverged(Exception):
    def __init__(self, step, loss):
        super().__init__(f"loss became {loss} at step {step}")
        self.step = step


def fail(step):
    raise TrainingDiverged(step, float("nan"))
""", 1, "TrainingDiverged: loss became nan at step 7", runners=(*DEFAULT_RUNNERS, DECORATOR),
        xfail={DECORATOR: "Python 3.10 re-raises from a with statement with the traceback it had, so the guard "
                          "cannot drop its decorator wrapper's frame"} if sys.version_info < (3, 11) else {}),
    "chained (from and context)": Kind(
        """
def load(step):
    return {}["lr"]


def fail(step):
    try:
        try:
            load(step)
        except KeyError:
            raise ValueError("config has no learning rate")  # implicit __context__
    except ValueError as err:
        raise RuntimeError(f"could not start step {step}") from err
""", 1, "RuntimeError: could not start step 7"),
    "__str__ raises": Kind(
        """
class Unprintable(Exception):
    def __str__(self):
        raise ValueError("__str__ is broken")


def fail(step):
    raise Unprintable(step)
""", 1, "Unprintable: <exception str() failed>"),
    "OOM class, __str__ raises": Kind(
        """
class OutOfMemoryError(RuntimeError):  # torch's name and module: gpumemd takes it for an OOM
    def __str__(self):
        raise ValueError("__str__ is broken")


OutOfMemoryError.__module__ = "torch.cuda"


def fail(step):
    raise OutOfMemoryError(step)
""", 1, "torch.cuda.OutOfMemoryError: <exception str() failed>", oom=True),
    "CUDA OOM text, 400-digit sizes": Kind(
        f"""
def fail(step):
    raise RuntimeError({_cuda_oom_text(400)!r})
""", 1, f"RuntimeError: {_cuda_oom_text(400)}", oom=True),
    "CUDA OOM text, 5000-digit sizes": Kind(
        f"""
def fail(step):
    raise RuntimeError({_cuda_oom_text(5000)!r})
""", 1, f"RuntimeError: {_cuda_oom_text(5000)}", oom=True, runners=(*DEFAULT_RUNNERS, BOTH)),
    "CPU OOM text": Kind(
        f"""
def fail(step):
    raise RuntimeError({CPU_OOM_TEXT!r})
""", 1, f"RuntimeError: {CPU_OOM_TEXT}", oom=True),
    "SystemExit(3)": Kind(
        """
def fail(step):
    raise SystemExit(3)
""", 3, None, traceback=False),
    "SystemExit('message')": Kind(
        """
def fail(step):
    raise SystemExit(f"fatal: no data for step {step}")
""", 1, "fatal: no data for step 7", traceback=False),
    "sys.exit(0)": Kind(
        """
def fail(step):
    sys.exit(0)
""", 0, None, traceback=False),
    "sys.exit(object whose __str__ raises)": Kind(
        """
class Unprintable:
    def __str__(self):
        raise ValueError("__str__ is broken")


def fail(step):
    sys.exit(Unprintable())
""", 1, "", traceback=False, runners=(RUN,),
        skip="python >= 3.12 prints the ValueError that str() left pending (3.13: 'Exception ignored on threading "
             "shutdown'), an interpreter accident gpumemd does not imitate" if sys.version_info >= (3, 12) else None),
    "KeyboardInterrupt": Kind(
        """
def fail(step):
    raise KeyboardInterrupt
""", -signal.SIGINT, "KeyboardInterrupt"),
    "SyntaxError in the script": Kind(
        """
def fail(step):
    return (step,
""", 1, "SyntaxError: '(' was never closed", traceback=False, stdout="", runners=(RUN,)),
    "the job's sys.excepthook raises": Kind(
        """
def fail(step):
    raise LookupError(f"no shard for step {step}")
""", 1, "LookupError: no shard for step 7", top="""

def failing_hook(exc_type, exc, tb):
    raise ValueError(f"the job's excepthook failed on {exc_type.__name__}")


sys.excepthook = failing_hook
"""),
    "RecursionError": Kind(
        """
def fail(step):
    return fail(step + 1)
""", 1, "RecursionError: maximum recursion depth exceeded", runners=(RUN,),
        xfail={RUN: "gpumemd run executes the script about a dozen Python frames deep (runpy, gpumemd.cli), so "
                    "the recursion limit comes that many calls sooner and '[Previous line repeated N more times]' "
                    "counts fewer; raising the limit to make up would change what sys.getrecursionlimit() "
                    "returns to the script and what its own sys.setrecursionlimit(n) allows"}),
}

# gpumemd's own stderr lines: the logger's ("gpumemd: ...", "gpumemd[rank 1/2]: ...") and the start and
# exit lines. Nothing the scripts write starts like this.
OWN_LINE = re.compile(r"^gpumemd(\[[^\]\n]*\])?: .*\n?", re.MULTILINE)


def _case(kind: str, runner: str | None, why: str | None) -> object:
    marks = [pytest.mark.xfail(strict=True, raises=AssertionError, reason=why)] if why else []
    if KINDS[kind].skip:
        marks = [pytest.mark.skip(reason=KINDS[kind].skip)]
    if runner is None:
        return pytest.param(kind, id=kind, marks=marks)
    return pytest.param(kind, runner, id=f"{kind} | {runner}", marks=marks)


BASELINES = [_case(name, None, None) for name in KINDS]
CASES = [_case(name, runner, kind.xfail.get(runner)) for name, kind in KINDS.items() for runner in kind.runners]
REPORT_CASES = [_case(name, runner, None) for name, kind in KINDS.items() for runner in kind.runners]


@dataclass(frozen=True)
class Outcome:
    returncode: int
    stdout: str
    stderr: str
    reports: int  # report directories written


def _slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def _execute(root: Path, kind: str, runner: str) -> Outcome:
    script = f"{_slug(kind)}/script.py"  # relative, as typed; python shows it absolute
    out = root / "out" / _slug(kind) / _slug(runner)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPUMEMD_", "TRANSPARENCY_"))}
    env["GPUMEMD_OUTPUT_DIR"] = str(out)
    if runner in (GUARD, BOTH):
        env["TRANSPARENCY_GUARD"] = "with"
    elif runner == DECORATOR:
        env["TRANSPARENCY_GUARD"] = "decorator"
    gpumemd_run = [sys.executable, "-m", "gpumemd", "run"] if runner in (RUN, BOTH) else [sys.executable]
    done = subprocess.run([*gpumemd_run, script], cwd=root, env=env, capture_output=True, text=True, timeout=120)
    reports = len(list(out.glob("oom-*/report.json"))) if out.exists() else 0
    return Outcome(done.returncode, done.stdout, done.stderr, reports)


@pytest.fixture(scope="module")
def outcomes(request: pytest.FixtureRequest,
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[tuple[str, str], Future[Outcome]]]:
    """The runs the selected tests of this file need, and the python baselines, run concurrently."""
    wanted: set[tuple[str, str]] = set()
    for item in request.session.items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if getattr(item, "path", None) == Path(__file__) and "kind" in params and not item.get_closest_marker("skip"):
            wanted |= {(params["kind"], "python"), (params["kind"], params.get("runner", "python"))}
    root = tmp_path_factory.mktemp("transparency")
    for name, kind in KINDS.items():
        (root / _slug(name)).mkdir()
        (root / _slug(name) / "script.py").write_text(PRELUDE.format(top=kind.top) + kind.body + FRAMES)
    order = sorted(wanted, key=lambda pair: pair[1] == "python")  # torch first: baselines take milliseconds
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 2)) as pool:
        futures = {pair: pool.submit(_execute, root, *pair) for pair in order}
        yield futures
        for future in futures.values():
            future.cancel()


@pytest.mark.parametrize("kind", BASELINES)
def test_the_python_baseline_is_what_the_kind_says(kind: str,
                                                   outcomes: dict[tuple[str, str], Future[Outcome]]) -> None:
    base, expected = outcomes[(kind, "python")].result(), KINDS[kind]
    assert base.returncode == expected.returncode, base.stderr
    assert base.stdout == expected.stdout
    last = (base.stderr.splitlines() or [None])[-1]
    if last is not None and sys.version_info < (3, 11):
        last = last.removeprefix("__main__.")  # 3.10 names the script's own classes so
    assert last == expected.last_line, base.stderr
    if expected.traceback:
        assert "Traceback (most recent call last):\n" in base.stderr
        for frame in ("<module>", "outer", "middle", "fail"):
            assert f", in {frame}\n" in base.stderr
    assert "gpumemd" not in base.stderr and base.reports == 0


@pytest.mark.parametrize(("kind", "runner"), CASES)
def test_gpumemd_changes_nothing_the_job_shows(kind: str, runner: str,
                                               outcomes: dict[tuple[str, str], Future[Outcome]]) -> None:
    base, seen = outcomes[(kind, "python")].result(), outcomes[(kind, runner)].result()
    context = f"{kind} under {runner}\n--- python stderr:\n{base.stderr}\n--- {runner} stderr:\n{seen.stderr}"
    assert seen.returncode == base.returncode, context  # a negative one is the signal that ended it
    assert seen.stdout == base.stdout, context
    assert OWN_LINE.sub("", seen.stderr) == base.stderr, context


@pytest.mark.parametrize(("kind", "runner"), REPORT_CASES)
def test_the_agent_was_there_and_reported_each_oom_once(kind: str, runner: str,
                                                        outcomes: dict[tuple[str, str], Future[Outcome]]) -> None:
    """Transparency is not bought by doing nothing: an OOM gets one report (from the guard or from the
    excepthook, never both), anything else none."""
    seen = outcomes[(kind, runner)].result()
    assert seen.reports == (1 if KINDS[kind].oom else 0), seen.stderr
