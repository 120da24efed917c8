"""The agent picks up the real rank when torch.distributed is initialised after attach."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import gpumemd


@pytest.fixture
def process_group(tmp_path: Path):  # type: ignore[no-untyped-def]
    yield lambda: dist.init_process_group(
        "gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1
    )
    if dist.is_initialized():
        dist.destroy_process_group()


def test_rank_is_refreshed_when_the_process_group_comes_after_attach(
    process_group, out_dir: str, monkeypatch: pytest.MonkeyPatch  # type: ignore[no-untyped-def]
) -> None:
    # The launcher says nothing (spawned workers often have no RANK variable).
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        monkeypatch.delenv(var, raising=False)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    agent = gpumemd.attach(model=model, optimizer=opt, output_dir=out_dir, sample_interval_s=0)
    assert agent.state().identity.source == "default"

    process_group()
    model(torch.randn(3, 4)).sum().backward()
    opt.step()

    ident = agent.state().identity
    assert (ident.source, ident.rank, ident.world_size) == ("torch.distributed", 0, 1)


def test_log_lines_name_the_rank(out_dir: str, monkeypatch: pytest.MonkeyPatch,
                                 caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    gpumemd.attach(output_dir=out_dir, sample_interval_s=0)
    with caplog.at_level(logging.WARNING, logger="gpumemd"):
        logging.getLogger("gpumemd").warning("gpumemd: something %s", "odd")
    assert caplog.records[-1].getMessage() == "gpumemd[rank 1/2]: something odd"

    gpumemd.detach()  # the filter goes with the agent
    with caplog.at_level(logging.WARNING, logger="gpumemd"):
        logging.getLogger("gpumemd").warning("gpumemd: after %s", "detach")
    assert caplog.records[-1].getMessage() == "gpumemd: after detach"
