"""Rank, local rank and world size from each launcher's environment; the rank in log lines."""

from __future__ import annotations

import logging

import pytest

from gpumemd.probes.process.identity import RankLogFilter, current_identity, identity_from_env, rank_prefix
from gpumemd.records.step import Identity


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "8"}, (3, 1, 8, "torchrun")),
        ({"SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NTASKS": "16"}, (5, 1, 16, "slurm")),
        ({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_SIZE": "4"},
         (2, 0, 4, "openmpi")),
        ({"PMI_RANK": "1", "MPI_LOCALRANKID": "1", "PMI_SIZE": "2"}, (1, 1, 2, "mpich")),
        # `srun torchrun ...`: the worker carries both; torchrun's per-worker values win.
        ({"SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NTASKS": "2",
          "RANK": "6", "LOCAL_RANK": "2", "WORLD_SIZE": "8"}, (6, 2, 8, "torchrun")),
        # A stray, unparsable RANK falls through to the next launcher instead of failing the job.
        ({"RANK": "abc", "SLURM_PROCID": "1", "SLURM_LOCALID": "1", "SLURM_NTASKS": "2"}, (1, 1, 2, "slurm")),
        # Local rank missing: the rank stands in (single node); world size missing: at least rank + 1.
        ({"RANK": "3"}, (3, 3, 4, "torchrun")),
    ],
)
def test_identity_from_launcher_environment(env: dict[str, str], expected: tuple[int, int, int, str]) -> None:
    ident = identity_from_env(env)
    assert ident is not None
    assert (ident.rank, ident.local_rank, ident.world_size, ident.source) == expected


def test_no_launcher_is_a_single_process() -> None:
    assert identity_from_env({"PATH": "/bin", "RANK": "-1"}) is None
    ident = current_identity({})
    assert (ident.rank, ident.local_rank, ident.world_size, ident.source) == (0, 0, 1, "default")
    assert ident.pid > 0 and ident.hostname


def _record(msg: str) -> logging.LogRecord:
    return logging.LogRecord("gpumemd", logging.WARNING, __file__, 1, msg, ("x",), None)


def test_log_lines_carry_the_rank_in_multi_process_jobs() -> None:
    identity: list[Identity | None] = [Identity(rank=1, local_rank=1, world_size=2)]
    flt = RankLogFilter(lambda: identity[0])

    record = _record("gpumemd: leak suspected on %s")
    assert flt.filter(record)
    assert record.getMessage() == "gpumemd[rank 1/2]: leak suspected on x"
    assert record.gpumemd_rank == 1  # type: ignore[attr-defined]

    identity[0] = Identity()  # single process: lines stay as written
    single = _record("gpumemd: leak suspected on %s")
    assert flt.filter(single) and single.getMessage() == "gpumemd: leak suspected on x"

    identity[0] = None  # not started yet: untouched
    early = _record("gpumemd: x %s")
    assert flt.filter(early) and early.getMessage() == "gpumemd: x x"


def test_rank_prefix() -> None:
    assert rank_prefix(Identity()) == "gpumemd"
    assert rank_prefix(Identity(rank=7, world_size=8)) == "gpumemd[rank 7/8]"
