"""Who this process is in its job: rank, local rank, world size.

torch.distributed when it is initialised, otherwise the launcher's environment (torchrun, Slurm,
Open MPI), otherwise a single process.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Mapping

from gpumemd.records.step import Identity

_LAUNCHERS: tuple[tuple[str, str, str, str], ...] = (
    # (source, rank var, local rank var, world size var)
    ("torchrun", "RANK", "LOCAL_RANK", "WORLD_SIZE"),
    ("slurm", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS"),
    ("openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_SIZE"),
)


def identity_from_env(env: Mapping[str, str]) -> Identity | None:
    """The launcher's identity from environment variables alone (pure)."""
    for source, rank_var, local_var, world_var in _LAUNCHERS:
        if rank_var in env:
            try:
                rank = int(env[rank_var])
                local = int(env.get(local_var, env[rank_var]))
                world = int(env.get(world_var, "1"))
            except ValueError:
                continue
            return Identity(rank=rank, local_rank=local, world_size=world, source=source)
    return None


def current_identity(env: Mapping[str, str] | None = None) -> Identity:
    env = os.environ if env is None else env
    base = identity_from_env(env) or Identity()
    rank, world, source = base.rank, base.world_size, base.source
    dist = _initialized_dist()
    if dist is not None:
        try:
            rank, world, source = int(dist.get_rank()), int(dist.get_world_size()), "torch.distributed"
        except (RuntimeError, ValueError):
            pass
    return Identity(
        rank=rank,
        local_rank=base.local_rank,
        world_size=world,
        hostname=socket.gethostname(),
        pid=os.getpid(),
        source=source,
    )


def _initialized_dist():  # type: ignore[no-untyped-def]
    torch = sys.modules.get("torch")  # never import torch just to ask
    if torch is None:
        return None
    dist = getattr(torch, "distributed", None)
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            return dist
    except (RuntimeError, ValueError, AttributeError):
        return None
    return None
