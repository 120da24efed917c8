"""A finding a person was told of and that another series accounts for is withdrawn, and its end is
said: host RSS suspected while the tensors that explain it were not yet counted used to vanish from
the findings with no line (a user read "host memory leak suspected … out of memory in ~8 min" and
never heard of it again)."""

from __future__ import annotations

import logging
import time
from types import SimpleNamespace
from typing import Any

import pytest

from gpumemd.analysis.leak_causes import NO_CAUSES, merge_causes
from gpumemd.analysis.leak_types import LeakState, SeriesSpec, TrackStatus
from gpumemd.analysis.trend import Slope, Verdict
from gpumemd.components.leak_findings import LeakFindings
from gpumemd.components.leak_options import LeakOptions
from gpumemd.components.leak_pending import PendingEvaluation
from gpumemd.config import Config
from gpumemd.records.device import CPU
from gpumemd.records.findings import Culprit, Finding

HOST = Finding(kind="host_leak", series="host_rss_bytes", state="suspected", slope_bytes_per_step=36e3,
               slope_low=3e4, slope_high=4e4, onset_step=982, growth_bytes=10**7, steps_to_oom=1e4, first_step=1352,
               updated_step=1352, summary="", headline="host memory leak suspected: +36.1 KiB/step", device=CPU)
KEPT = Finding(kind="tensor_leak", series="tensors{device=cpu,group=float32[64]}", state="confirmed",
               slope_bytes_per_step=256.0, slope_low=250.0, slope_high=260.0, onset_step=1000, growth_bytes=10**5,
               steps_to_oom=1e8, first_step=1405, updated_step=1505, summary="", headline="", device=CPU,
               culprits=(Culprit(description="float32[64]", count_delta=400, bytes_delta=10**5,
                                 holder="`val_preds` in <module>() at train.py:5 → list of 400 items"),))


def _explained(step: int) -> TrackStatus:
    """Host RSS's status once the tensors account for it: cleared by an explained verdict."""
    verdict = Verdict(passed=False, reason="explained by tensors{device=cpu,*", slope=Slope(3.6e4, 3e4, 4e4, 50),
                      p_increasing=0.0)
    return TrackStatus(spec=SeriesSpec("host_rss_bytes", "host_leak", CPU), phase=HOST.phase, state=LeakState.CLEARED,
                       changed=True, step=step, first_step=1352, verdict=verdict, window_start=0.0, onset_step=982,
                       growth_bytes=1e7)


def _conclude(findings: dict[tuple[str, str], Finding], tmp_path: Any) -> list[Any]:
    leak = LeakFindings(Config().options(LeakOptions), census=None, wall_clock=time.time)
    published: list[Any] = []
    agent = SimpleNamespace(output_dir=str(tmp_path), published=SimpleNamespace(census=None),
                            publish=lambda **changes: published.append(changes["findings"]),
                            state=lambda: SimpleNamespace(identity=SimpleNamespace(rank=0)))
    leak._findings = dict(findings)
    leak._causes = merge_causes(leak._findings, NO_CAUSES)
    series = SimpleNamespace(scans=SimpleNamespace(chain_nodes=SimpleNamespace(names=set)),
                             host_spec=SimpleNamespace(name="host_rss_bytes"))
    leak.conclude(agent, series, PendingEvaluation(1555, [_explained(1555)], set(), []))  # type: ignore[arg-type]
    return published


@pytest.mark.parametrize("with_tensors", [False, True])
def test_a_withdrawn_suspicion_is_said_with_what_accounts_for_it(
        with_tensors: bool, tmp_path: Any, caplog: pytest.LogCaptureFixture) -> None:
    findings = {(HOST.series, HOST.phase): HOST}
    if with_tensors:
        findings[(KEPT.series, KEPT.phase)] = KEPT
    with caplog.at_level(logging.WARNING, logger="gpumemd"):
        published = _conclude(findings, tmp_path)

    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    what = ("the tensor leak held by `val_preds` in <module>() at train.py:5" if with_tensors
            else "the growth of the tensors the agent counts")
    assert lines == [f"gpumemd: host memory leak suspected since step 982 withdrawn: {what} accounts for its growth, "
                     "+35.2 KiB/step"]
    assert [f.series for f in published[-1]] == ([KEPT.series] if with_tensors else [])


def test_a_cleared_finding_that_is_then_explained_says_nothing_more(tmp_path: Any,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    cleared = Finding(**{**{f: getattr(HOST, f) for f in HOST.__dataclass_fields__}, "state": "cleared"})
    with caplog.at_level(logging.WARNING, logger="gpumemd"):
        _conclude({(cleared.series, cleared.phase): cleared}, tmp_path)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_tensors_said_before_the_graph_that_keeps_them_was_are_withdrawn_into_it(
        tmp_path: Any, caplog: pytest.LogCaptureFixture) -> None:
    # Predictions kept with their graphs (`history.append(model(x))`): the graphs' saved activations,
    # whose Python wrappers torch preserves, are counted at scans too and may be raised first, named by
    # whatever graph the search came by ("kept alive by the autograd graph of float32[] ..., held by
    # `loss`"). Once the graph finding is raised they are withheld as its tensors, but the finding said
    # of them stood beside it to the end of the run (`gpumemd demo` under load, census every 40 steps).
    from gpumemd.components.leak_evidence import Evidence

    saved = Finding(kind="graph_leak", series="tensors{device=cpu,group=float32[256, 512] with grad_fn}",
                    state="suspected", slope_bytes_per_step=2.5e6, slope_low=2e6, slope_high=3e6, onset_step=56,
                    growth_bytes=10**7, steps_to_oom=1e4, first_step=70, updated_step=70, summary="",
                    headline="retained autograd graph suspected: +1 tensor/step", device=CPU)
    graphs = Finding(kind="graph_leak", series="tensors{device=cpu,group=float32[256, 10] with grad_fn}",
                     state="suspected", slope_bytes_per_step=1.3e6, slope_low=1e6, slope_high=1.5e6, onset_step=59,
                     growth_bytes=10**7, steps_to_oom=1e4, first_step=90, updated_step=90, summary="", headline="",
                     device=CPU, culprits=(Culprit(description="float32[256, 10] with grad_fn", count_delta=30,
                                                   bytes_delta=10**5, holder="`history` in run() at demo.py:46"),))
    leak = LeakFindings(Config().options(LeakOptions), census=None, wall_clock=time.time)
    published: list[Any] = []
    agent = SimpleNamespace(output_dir=str(tmp_path), published=SimpleNamespace(census=None),
                            publish=lambda **changes: published.append(changes["findings"]),
                            state=lambda: SimpleNamespace(identity=SimpleNamespace(rank=0)))
    leak._findings = {(saved.series, saved.phase): saved, (graphs.series, graphs.phase): graphs}
    leak._causes = merge_causes(leak._findings, NO_CAUSES)
    leak._culprits = {(saved.series, saved.phase): Evidence(graph_kept=True),
                      (graphs.series, graphs.phase): Evidence(culprits=graphs.culprits, kind="graph_leak")}
    status = TrackStatus(spec=SeriesSpec(saved.series, "tensor_leak", CPU, sparse=True, unit="tensors"),
                         phase=saved.phase, state=LeakState.SUSPECTED, changed=False, step=100, first_step=70,
                         verdict=Verdict(True, "leak", Slope(1.0, 0.9, 1.1, 20), 1e-6), window_start=40.0,
                         onset_step=56, growth_bytes=1e7)
    series = SimpleNamespace(scans=SimpleNamespace(chain_nodes=SimpleNamespace(names=set)),
                             host_spec=SimpleNamespace(name="host_rss_bytes"))
    with caplog.at_level(logging.WARNING, logger="gpumemd"):
        leak.conclude(agent, series, PendingEvaluation(100, [status], {saved.series}, []))  # type: ignore[arg-type]

    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(lines) == 1 and lines[0].startswith(
        "gpumemd: retained autograd graph suspected since step 56 withdrawn: the retained autograd graph held by "
        "`history` in run() at demo.py:46"), lines
    assert [f.series for f in published[-1]] == [graphs.series]
