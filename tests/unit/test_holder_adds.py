"""The line that adds to a holder, read from source with ``ast`` (``analysis.holder_adds``)."""

from __future__ import annotations

import textwrap

from gpumemd.analysis.holder_adds import Addition, added_at, adding_line, adding_words, scan

_SOURCE = textwrap.dedent('''\
    import torch

    CAPTURED = []


    class Probe:
        def __init__(self):
            self.outputs = []

        def hook(self, module, inputs, output):
            self.outputs.append(output)


    def train(model, batches):
        history = []
        total = 0
        cache = {}
        acts = torch.zeros(0)
        never = []
        for step, batch in enumerate(batches):
            out = model(batch)
            history.append(out)
            total += out.sum()
            cache[step] = out
            acts = torch.cat([acts, out])
        return never


    @torch.no_grad()
    def evaluate(model, batches):
        history = []
        history.extend(model(b) for b in batches)


    model = torch.nn.Linear(2, 2)
    model.register_forward_hook(lambda m, i, o: CAPTURED.append(o))
''')
_ADDS = scan(_SOURCE)
_TRAIN = _SOURCE.splitlines().index("def train(model, batches):") + 1
_EVALUATE = _SOURCE.splitlines().index("@torch.no_grad()") + 1  # co_firstlineno counts the decorator


def _line(text: str) -> int:
    return next(n for n, line in enumerate(_SOURCE.splitlines(), 1) if line.strip() == text)


def test_each_way_of_adding_to_a_local_is_found_in_its_function() -> None:
    assert adding_line(_ADDS, "history", _TRAIN) == Addition("history", "appended", _line("history.append(out)"))
    assert adding_line(_ADDS, "total", _TRAIN) == Addition("total", "incremented", _line("total += out.sum()"))
    assert adding_line(_ADDS, "cache", _TRAIN) == Addition("cache", "stored", _line("cache[step] = out"))
    assert adding_line(_ADDS, "acts", _TRAIN) == Addition(
        "acts", "concatenated", _line("acts = torch.cat([acts, out])"))


def test_a_name_is_looked_for_in_its_own_function_only() -> None:
    # `history` of evaluate() (decorated: its code starts at the decorator) is extended, not appended
    assert adding_line(_ADDS, "history", _EVALUATE) == Addition(
        "history", "extended", _line("history.extend(model(b) for b in batches)"))


def test_a_method_on_an_attribute_is_found_from_the_object_the_job_names() -> None:
    # the holder path starts at the job's variable (`probe.outputs`); the line says `self.outputs`
    found = adding_line(_ADDS, "probe.outputs", _TRAIN)
    assert found == Addition("self.outputs", "appended", _line("self.outputs.append(output)"))


def test_a_global_a_hook_appends_to_is_found_in_the_whole_file() -> None:
    found = adding_line(_ADDS, "CAPTURED", None)
    assert found is not None and found.verb == "appended"
    assert found.line == _line("model.register_forward_hook(lambda m, i, o: CAPTURED.append(o))")


def test_nothing_is_said_for_a_name_nothing_adds_to() -> None:
    assert adding_line(_ADDS, "never", _TRAIN) is None
    assert adding_line(_ADDS, "model", None) is None
    assert adding_line(_ADDS, "history", _TRAIN + 1) is None  # no function starts there: no guess
    assert adding_line(scan("def broken(:\n"), "x", None) is None  # source that does not parse


def test_the_words_read_back_into_the_findings_field() -> None:
    words = adding_words(Addition("history", "appended", 57), "job/train.py")
    holder = f"`history` in main() at job/train.py:12, {words} → list of 3 items"

    assert words == "appended at job/train.py:57"
    assert added_at(holder) == "job/train.py:57"
    assert added_at("`history` in main() at job/train.py:12 → list of 3 items") is None
