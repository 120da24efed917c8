"""The line that adds to a holder: the ``append``, the ``+=``, the ``x[k] = ...``, the ``torch.cat``.

A holder path names where the holder lives ("`history` in main() at train.py:5", its first store);
what a user changes is the line that keeps adding to it. ``scan(source)`` reads a file's source with
``ast`` (never executed) once into the statements that add to a name or attribute; ``adding_line``
picks the one for a holder's expression. Pure: the probe reads the file (``probes.holding.holder_roots``).

What counts as adding: a call of a growing method on the expression (``history.append(x)``,
``self.outputs.extend(xs)``, ``seen.add(k)``, ``cache.update(d)``), an augmented assignment to it
(``total += loss``), a store into it (``cache[step] = t``), and an assignment of a concatenation
that reads it (``acts = torch.cat([acts, a])``). Each is worded with a verb ending in "ed"
("appended at train.py:57"): ``ADDED`` reads the words back for the finding's ``added_at`` field.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable
from dataclasses import dataclass

_METHODS = {"append": "appended", "appendleft": "appended", "extend": "extended", "extendleft": "extended",
            "insert": "inserted", "add": "added", "update": "updated", "setdefault": "updated",
            "put": "queued", "put_nowait": "queued"}
_CONCAT = frozenset({"cat", "concat", "concatenate", "stack", "hstack", "vstack"})
VERBS = (*dict.fromkeys(_METHODS.values()), "stored", "incremented", "concatenated")  # every verb ``_addition`` uses

ADDED = re.compile(r", ((?:" + "|".join(VERBS) + r") at ([^\s,()→]+:\d+))")
"""The adding line in a holder path: group 1 its words ("appended at train.py:57"), group 2 where."""

UNTIL_RESET = "kept until reset()"
"""How a holder path says its container is a torchmetrics metric's state: every ``update()`` is kept
until the metric's ``reset()``, which is the fix (``announce.fix_words``), not a bounded deque."""

_METRIC_STATE = re.compile(r"^`(.+)\.\w+`(.*) \(a (\w+)'s state, " + re.escape(UNTIL_RESET) + r"\)$")


def metric_owner(hop: str) -> str | None:
    """The metric whose state a holder path's hop is, as a hop of its own ("`auroc` in main() at x.py:8
    (a BinaryAUROC: its states kept until reset())" for "`auroc.preds` in main() at x.py:8 (a
    BinaryAUROC's state, kept until reset())"); None for any other hop. One ``update()`` appends to each
    of a metric's states (preds and target): they grow together, one cause with one fix."""
    match = _METRIC_STATE.match(hop)
    return f"`{match[1]}`{match[2]} (a {match[3]}: its states {UNTIL_RESET})" if match else None


def common_metric(first_hops: Iterable[str]) -> str | None:
    """The metric (``metric_owner``) whose states every one of these holder paths' first hops is, if one."""
    owners = {metric_owner(hop) for hop in first_hops}
    return owners.pop() if len(owners) == 1 else None


@dataclass(frozen=True, slots=True)
class Addition:
    """One statement that adds to ``expr`` (a dotted name as written: ``self.outputs``)."""

    expr: str
    verb: str
    line: int


@dataclass(frozen=True, slots=True)
class SourceAdds:
    """What ``scan`` keeps of one file: its additions, and each function's lines (first line, its
    decorators' included as ``co_firstlineno`` counts them; last line)."""

    additions: tuple[Addition, ...] = ()
    functions: tuple[tuple[int, int], ...] = ()


NOTHING = SourceAdds()


def scan(source: str) -> SourceAdds:
    """The additions and functions of ``source``; nothing for source that does not parse."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError, RecursionError):
        return NOTHING
    additions: list[Addition] = []
    functions: list[tuple[int, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            functions.append((first, node.end_lineno or node.lineno))
        found = _addition(node)
        if found is not None:
            additions.append(found)
    additions.sort(key=lambda a: a.line)
    return SourceAdds(tuple(additions), tuple(functions))


def _addition(node: ast.AST) -> Addition | None:
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _METHODS:
        expr = dotted(node.func.value)
        return Addition(expr, _METHODS[node.func.attr], node.lineno) if expr else None
    if isinstance(node, ast.AugAssign) and isinstance(node.op, ast.Add):
        expr = dotted(node.target)
        return Addition(expr, "incremented", node.lineno) if expr else None
    if isinstance(node, ast.Assign):
        for target in node.targets:
            if isinstance(target, ast.Subscript) and (expr := dotted(target.value)):
                return Addition(expr, "stored", node.lineno)
            expr = dotted(target)
            if expr and _concatenates(node.value, expr):
                return Addition(expr, "concatenated", node.lineno)
    return None


def _concatenates(value: ast.expr, expr: str) -> bool:
    """``torch.cat([expr, ...])`` and the like: a concatenation whose arguments read ``expr``."""
    if not isinstance(value, ast.Call):
        return False
    func = value.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
    return name in _CONCAT and any(isinstance(n, (ast.Name, ast.Attribute)) and dotted(n) == expr
                                   for arg in value.args for n in ast.walk(arg))


def dotted(node: ast.AST) -> str | None:
    """``a.b.c`` for a chain of attributes on a name, else None."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(node.id)
    return ".".join(reversed(parts))


def adding_line(adds: SourceAdds, expr: str, first_line: int | None) -> Addition | None:
    """The first statement that adds to ``expr``: the expression itself within the function that
    starts at ``first_line`` (its nested functions, a hook defined there, included; the whole file
    for a module's name, ``first_line`` None), else, for an attribute (``attention.attn_maps``), the
    same attribute on any object in the file (``self.attn_maps[step] = ...`` in the class's method).
    None when nothing adds to it: a guess at another variable's line would mislead."""
    scope = (0, 1 << 30)
    if first_line is not None:
        function = next(((a, b) for a, b in adds.functions if a == first_line), None)
        if function is None:
            return None  # the function is not where the file says (edited since it was loaded)
        scope = function
    # a queue.Queue's items are its `.queue`: what adds to them is `pending.put(x)`
    names = (expr, expr.removesuffix(".queue")) if expr.endswith(".queue") else (expr,)
    found = next((add for add in adds.additions if add.expr in names and scope[0] <= add.line <= scope[1]), None)
    attribute = expr.rpartition(".")[2] if "." in expr else None
    if found is None and attribute:
        found = next((add for add in adds.additions if add.expr.endswith("." + attribute)), None)
    return found


def adding_words(addition: Addition, path: str) -> str:
    """"appended at train.py:57"."""
    return f"{addition.verb} at {path}:{addition.line}"


def added_at(holder: str | None) -> str | None:
    """Where a holder path says its holder is added to ("train.py:57"), or None."""
    found = ADDED.search(holder) if holder else None
    return found.group(2) if found else None
