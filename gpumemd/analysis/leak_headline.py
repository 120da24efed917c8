"""The line a person reads once: a leak finding's state change, in at most ``HEADLINE_MAX`` characters.

Pure (no torch, no I/O). The WARNING line of a state change says what changed and what to look at:
the kind, the rate, who holds it, since when, and when memory runs out ("tensor leak confirmed: +1
tensor/step (~2.0 KiB/step) held by `kept` in main() at train.py:12, since step 300, out of memory in
~1.3 h"). Everything else a finding knows (groups, container sizes, sites, bounds, when the culprit
was looked up) stays in its ``summary``, which the findings file, ``agent.findings()`` and
``gpumemd report`` keep whole. The exit summary names each finding once, shorter still
(``mention``), and without the sizes a state change saw: they are stale by the end of the run.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from gpumemd.analysis.holder_adds import VERBS, common_metric
from gpumemd.analysis.units import format_bytes
from gpumemd.records.findings import Culprit, Finding

HEADLINE_MAX = 200
"""Characters of the logged line at most, its ``gpumemd: `` prefix included."""

_PREFIX = "gpumemd: "
_MENTION_HOLDER_MAX = 90  # a holder in the exit summary, which may name several findings

KIND_WORDS = {
    "tensor_leak": "tensor leak",
    "graph_leak": "retained autograd graph",
    "fragmentation": "allocator fragmentation",
    "non_pytorch": "memory outside PyTorch's allocator",
    "host_leak": "host memory leak",
}

# Sizes and counts in a holder path ("list of 1,204 items", "(a key; 12 items)", "(3,001 nodes)"):
# true when the path was found, stale soon after; the finding's summary keeps them.
_SIZES = (
    re.compile(r" \((a key; )?[\d,]+ items?\)"),
    re.compile(r" \([\d,]+ (autograd )?nodes\)"),
    re.compile(r"(?<=\w) of [\d,]+( items?)?\b"),
)
# " at train.py:12", where a holder lives; not where it is added to (", appended at train.py:57": every
# verb of analysis.holder_adds ends in "ed"), which is what the user changes
_LOCATION = re.compile(r"(?<!ed) at [^\s,()→]+:\d+")
_ADDED_DIRS = re.compile(r"(?<=ed at )[^\s,()→]*/(?=[^/\s,()→]+:\d+)")  # "appended at job/train.py:57"
_ADDED_FILE = re.compile(r"(?<=ed at )[^/\s,()→]+:(?=\d+)")  # "appended at train.py:57" -> "appended at line 57"
_ADDED_LINE = re.compile(r", (?:" + "|".join(VERBS) + r") at (line )?[^\s,()→]*\d+")
_BARE_CONTAINER = re.compile(r"( → (list|dict|tuple|set|deque|OrderedDict|defaultdict))+$")
# What a path the climb's bounds cut says of itself (``probes.holding.holders``): the name before it stands
_CUT = re.compile(r"(, a finished frame)? \(path cut at depth \d+\)$")


@dataclass(frozen=True, slots=True)
class Facts:
    """What a headline says, each part already worded (None: not known, not said)."""

    kind: str
    state: str
    rate: str | None = None  # "+1 tensor/step (~2.0 KiB/step)"; None once the growth stopped
    where: str | None = None  # "cuda:0", "phase eval": what the kind alone leaves open
    holder: str | None = None  # "held by `kept` in main() at train.py:12"
    onset_step: int | None = None
    out_of_memory: str | None = None  # "~1.3 h", "~12,000 steps"
    stopped: str | None = None  # why a cleared finding cleared


def headline(facts: Facts) -> str:
    """The state change in one line of at most ``HEADLINE_MAX`` characters once logged: the holder
    is cut in its middle (its root, the name in the user's code, and its last hop stay) before
    anything else is."""
    head = f"{KIND_WORDS.get(facts.kind, facts.kind)} {facts.state}"
    if facts.where:
        head += f" ({facts.where})"
    if facts.rate is None:
        return _fit(f"{head}: growth stopped" + (f" ({facts.stopped})" if facts.stopped else ""))
    tail = ""
    if facts.onset_step is not None:
        tail += f", {since_words(facts.onset_step)}"
    if facts.out_of_memory:
        tail += f", out of memory in {facts.out_of_memory}"
    front = f"{head}: {facts.rate}"
    holder = facts.holder or ""
    room = HEADLINE_MAX - len(_PREFIX) - len(front) - len(tail) - 1
    return _fit(f"{front} {fit_holder(holder, room)}{tail}" if holder and room >= 24 else front + tail)


def holder_words(culprits: Sequence[Culprit], sites: Sequence[str]) -> str | None:
    """"held by <path>" for the top culprit (sizes left out), else where the growth was allocated."""
    if culprits:
        c = culprits[0]
        if not c.holder:
            return "(holder not found)"
        verb = "kept alive by" if c.holder.startswith(("the autograd graph", "autograd graph")) else "held by"
        if c.category == "workers":  # the job's child processes: the memory is theirs, not held
            verb = "in"
        return f"{verb} {short_path(c.holder)}"
    return f"allocated at {sites[0]}" if sites else None


def short_path(holder: str) -> str:
    """A holder path without the sizes and counts it had when found, nor a bare container type
    at its end ("`kept` in main() at train.py:12 → list of 1,204 items" → "`kept` in main() at
    train.py:12"), nor what a cut path says of itself ("..., a finished frame (path cut at depth 6)")."""
    holder = _CUT.sub("", holder)
    for pattern in _SIZES:
        holder = pattern.sub("", holder)
    return _BARE_CONTAINER.sub("", holder)


def mention(finding: Finding) -> str:
    """A finding named once in the exit summary: its kind, who holds it, its state and onset
    ("tensor leak held by `kept` in main() at train.py:12 (confirmed, since step 300)")."""
    text = KIND_WORDS.get(finding.kind, finding.kind)
    holder = holder_words(_shared(finding.culprits), finding.sites)
    if holder:
        text += " " + fit_holder(holder, _MENTION_HOLDER_MAX)
    state = finding.state + (f", {since_words(finding.onset_step)}" if finding.onset_step is not None else "")
    oom = projection_words(finding.steps_to_oom, finding.hours_to_oom)[1] if finding.state != "cleared" else None
    state += f", out of memory in {oom}" if oom else ""  # the finding's own: as its line and the metric say
    return f"{text} ({state})"


def withdrawn_line(finding: Finding, by: Finding | None) -> str:
    """The line that closes a finding a person was told of and that another accounts for now (host RSS
    rising with the tensors of a tensor leak): withdrawn, not cleared, as its growth goes on as that
    finding's ("host memory leak suspected since step 982 withdrawn: the tensor leak held by `kept` in
    main() at train.py:12 accounts for its growth, +86.1 KiB/step"). ``by``: that finding, when one is
    active. The withdrawn growth's own rate is kept in the line: it can be far above what the other
    finding states (small kept tensors fragment the heap: host RSS +97 KiB a step for 256 B of tensors)."""
    text = f"{KIND_WORDS.get(finding.kind, finding.kind)} {finding.state}"
    if finding.onset_step is not None:
        text += f" {since_words(finding.onset_step)}"
    rate = f", +{format_bytes(finding.slope_bytes_per_step)}/step" if finding.slope_bytes_per_step >= 1 else ""
    tail = f" accounts for its growth{rate}"
    what = "the growth of the tensors the agent counts"
    if by is not None:
        what = "the " + KIND_WORDS.get(by.kind, by.kind)
        holder = holder_words(_shared(by.culprits), by.sites)
        if holder:  # the holder in what the line has left of HEADLINE_MAX
            room = HEADLINE_MAX - len(f"{text} withdrawn: {what} {tail}")
            what += " " + fit_holder(holder, max(24, min(_MENTION_HOLDER_MAX, room)))
    return f"{text} withdrawn: {what}{tail}"


def fit_holder(holder: str, width: int) -> str:
    """A holder in ``width`` characters: without where it lives first (the name and the function say
    where; the summary keeps the line), then the directories of the line that adds to it ("appended
    at train.py:57"), then cut in its middle, keeping a root that says where it is added to before
    the hops below it. A root too long even so says that line shorter ("appended at line 57": it is
    in the root's own file), then not at all (the summary keeps it), and never loses its name."""
    if len(holder) <= width:
        return holder
    holder = _LOCATION.sub("", holder)
    if len(holder) > width:
        holder = _ADDED_DIRS.sub("", holder)
    for shorter, words in ((_ADDED_FILE, "line "), (_ADDED_LINE, "")):
        root, arrow, _ = holder.partition(" → ")
        if len(root) + (4 if arrow else 0) > width:  # the root, and " → …" after it
            holder = shorter.sub(words, holder)
    root = holder.partition(" → ")[0]
    if len(holder) <= width or not _ADDED_LINE.search(root):
        return cut_middle(holder, width)
    cut = cut_middle(holder, width)
    return cut if cut.startswith(root + " → ") else root + " → …"


def cut_middle(text: str, width: int) -> str:
    """``text`` in ``width`` characters at most, cut in its middle ("`kept` in main() … → list")."""
    if len(text) <= width:
        return text
    if width < 5:
        return text[:width]
    hops = text.split(" → ")
    if len(hops) > 2:
        # Whole hops only: the root (the name the user wrote), then as many of the last hops as fit.
        kept: list[str] = []
        for hop in reversed(hops[1:]):
            candidate = " → ".join([hops[0], "…", hop, *kept])
            if len(candidate) > width:
                break
            kept.insert(0, hop)
        if kept:
            return " → ".join([hops[0], "…", *kept])
    # the root whole when it fits, then as much of the last hop as fits
    first = text.find(" → ")
    head = max((width - 1) * 2 // 3, min(first, width - 8) if first > 0 else 0)
    tail = width - 1 - head
    return text[:head].rstrip() + "…" + text[len(text) - tail:].lstrip()


def _shared(culprits: Sequence[Culprit]) -> Sequence[Culprit]:
    """The culprits a finding names in one mention: several groups of one cause (one finding listing
    them) are named by the hops of their holder paths they share, as their headline does."""
    holders = [c.holder for c in culprits if c.holder]
    if len(holders) < 2 or len(holders) != len(culprits):
        return culprits
    paths = [short_path(h).split(" → ") for h in holders]
    common = " → ".join(shared_hops(paths)) or common_metric(path[0] for path in paths)
    return (dataclasses.replace(culprits[0], holder=common),) if common else culprits


def shared_hops(paths: Iterable[Sequence[str]]) -> list[str]:
    """The hops every path starts with (paths of different lengths share a prefix at most)."""
    return [hops[0] for hops in itertools.takewhile(lambda hops: len(set(hops)) == 1, zip(*paths, strict=False))]


def _fit(line: str) -> str:
    width = HEADLINE_MAX - len(_PREFIX)
    return line if len(line) <= width else line[: width - 1].rstrip() + "…"


def since_words(onset_step: float) -> str:
    """"since step 1,200"; a leak present from the start (an onset dated at or before step 0, where a
    container's length at its rate, or a fit, may put it) "since step 0, the first watched"."""
    return "since step 0, the first watched" if onset_step <= 0 else f"since step {onset_step:,.0f}"


def duration_words(hours: float) -> str:
    """"40 s", "12 min", "1.3 h", "3 days": a projected time to out-of-memory."""
    if hours * 60 < 1:
        return f"{max(1, round(hours * 3600))} s"
    if hours < 1:
        return f"{hours * 60:.0f} min"
    if hours < 48:
        return f"{hours:.1f} h"
    return f"{hours / 24:,.0f} days"


def nearer_line(finding: Finding, before: Finding | None) -> str:
    """The line said when a cause's projected out-of-memory comes within a day after its state change
    was said (``leak_causes.newly_critical``): its headline, and what it projected before, or that it
    projected nothing (its state unchanged, the line would read as a second state change)."""
    line = finding.headline or finding.summary
    if before is None:
        return line
    was = projection_words(before.steps_to_oom, before.hours_to_oom)[1]
    return f"{line} (was {was})" if was else f"{line} (not projected before)"


def projection_words(steps_to_oom: float | None, hours_to_oom: float | None) -> tuple[str | None, str | None]:
    """The projected time to out-of-memory as the summary says it ("~12 min (~4,461 steps)") and as
    the headline does ("~12 min"); (None, None) without a projection."""
    if steps_to_oom is None:
        return None, None
    steps = f"~{steps_to_oom:,.0f} steps"
    if hours_to_oom is None:
        return steps, steps
    return f"~{duration_words(hours_to_oom)} ({steps})", f"~{duration_words(hours_to_oom)}"
