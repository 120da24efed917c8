"""Who this process is in its job: rank, local rank, world size.

torch.distributed when it is initialised, otherwise the launcher's environment (torchrun, Slurm,
Open MPI, MPICH/Intel MPI), otherwise a single process. The identity names log lines, finding and
report files, metric labels and the exporter port (``port + local_rank``).

torch.distributed knows the global rank and world size but not the local rank, so the local rank
always comes from the launcher (0 when there is none).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
from collections.abc import Callable, Mapping
from typing import Any

from gpumemd.addresses import redacted
from gpumemd.records.step import Identity

_LAUNCHERS: tuple[tuple[str, str, str, str], ...] = (
    # (source, rank var, local rank var, world size var), first match wins. torchrun comes first:
    # `srun torchrun ...` workers carry both, and torchrun's are the per-worker ones.
    ("torchrun", "RANK", "LOCAL_RANK", "WORLD_SIZE"),
    ("slurm", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS"),
    ("openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_SIZE"),
    ("mpich", "PMI_RANK", "MPI_LOCALRANKID", "PMI_SIZE"),
)

# Identities that torch.distributed may refine; a framework's own ("lightning", "transformers") stays.
_ENV_SOURCES = frozenset({"default", *(launcher[0] for launcher in _LAUNCHERS)})


def identity_from_env(env: Mapping[str, str]) -> Identity | None:
    """The launcher's identity from environment variables alone (pure).

    A launcher whose variables do not parse as integers (or are out of range) is skipped, so a
    stray ``RANK=abc`` falls through to the next launcher instead of failing the job.
    """
    for source, rank_var, local_var, world_var in _LAUNCHERS:
        if rank_var in env:
            try:
                rank = int(env[rank_var])
                local = int(env.get(local_var, env[rank_var]))
                world = int(env.get(world_var, "1"))
            except ValueError:
                continue
            if rank < 0 or local < 0 or world < 1:
                continue
            return Identity(rank=rank, local_rank=local, world_size=max(world, rank + 1), source=source)
    return None


def current_identity(env: Mapping[str, str] | None = None) -> Identity:
    env = os.environ if env is None else env
    base = identity_from_env(env) or Identity()
    rank, world, source = base.rank, base.world_size, base.source
    dist = _initialized_dist()
    if dist is not None:
        with contextlib.suppress(RuntimeError, ValueError):  # 2.13 raises ValueError, older RuntimeError
            rank, world, source = int(dist.get_rank()), int(dist.get_world_size()), "torch.distributed"
    return Identity(
        rank=rank,
        local_rank=base.local_rank,
        world_size=world,
        hostname=socket.gethostname(),
        pid=os.getpid(),
        source=source,
    )


def refreshed_identity(previous: Identity) -> Identity | None:
    """A new identity when torch.distributed was initialised since ``previous`` was taken, else None.

    Cheap when nothing changed (a ``sys.modules`` lookup and ``is_initialized()``): the agent calls
    it on its first steps, because jobs often attach before ``init_process_group``.
    """
    if previous.source not in _ENV_SOURCES or _initialized_dist() is None:
        return None
    now = current_identity()
    return now if now.source == "torch.distributed" else None


def _initialized_dist() -> Any:
    torch = sys.modules.get("torch")  # never import torch just to ask
    if torch is None:
        return None
    dist = getattr(torch, "distributed", None)
    with contextlib.suppress(RuntimeError, ValueError, AttributeError):
        if dist is not None and dist.is_available() and dist.is_initialized():
            return dist
    return None


def rank_prefix(identity: Identity) -> str:
    """``"gpumemd[rank 3/8]"`` in a multi-process job, ``"gpumemd"`` otherwise."""
    if identity.world_size <= 1:
        return "gpumemd"
    return f"gpumemd[rank {identity.rank}/{identity.world_size}]"


class RankLogFilter(logging.Filter):
    """Puts the rank into the agent's log lines: ``gpumemd: ...`` becomes ``gpumemd[rank 1/2]: ...``.

    Every record also gets ``record.gpumemd_rank`` for users' own formatters. ``identity`` is called
    per record (so a rank refreshed after ``init_process_group`` shows up); it must be cheap. A URL's
    credentials in a message (a Pushgateway given as ``http://user:pw@host``) are written as ``***``.
    """

    def __init__(self, identity: Callable[[], Identity | None]) -> None:
        super().__init__("gpumemd")
        self._identity = identity

    def filter(self, record: logging.LogRecord) -> bool:
        if record.args or (isinstance(record.msg, str) and "@" in record.msg):  # a URL's credentials: never shown
            with contextlib.suppress(Exception):  # a message that cannot be formatted is the handler's to say
                text = record.getMessage()
                if "@" in text:
                    record.msg, record.args = redacted(text), None
        ident = self._identity()
        if ident is None:
            return True
        record.gpumemd_rank = ident.rank
        if ident.world_size > 1 and isinstance(record.msg, str) and record.msg.startswith("gpumemd:"):
            record.msg = rank_prefix(ident) + record.msg[len("gpumemd") :]
        return True
