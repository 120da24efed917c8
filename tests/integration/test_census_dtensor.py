"""DTensor parameters (FSDP2 ``fully_shard``) in a one-process gloo world: each local shard is
counted once, under the parameter's name, never again as an anonymous tensor."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn

from gpumemd.probes.census.census_steps import take_census


@pytest.fixture
def gloo_world() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # type: ignore[attr-defined]
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_fsdp2_dtensor_parameters_count_their_local_shard_once(gloo_world: None) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(9, 67), nn.Linear(67, 5))
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(3, 9)).sum().backward()
    opt.step()
    params = dict(model.named_parameters())
    assert all(isinstance(p, DTensor) for p in params.values())

    census = take_census(models=[model], optimizers=[opt], holders=0)

    for fqn, p in params.items():
        [group] = census.groups_named(fqn)
        assert (group.key.category, group.count, group.nbytes) == ("parameter", 1, p.numel() * 4)
        assert group.key.shape == tuple(p.shape)
        [exp_avg] = census.groups_named(f"Adam[{fqn}].exp_avg")
        assert exp_avg.nbytes == p.numel() * 4
    # The local shards are gc-visible plain tensors too: they must not appear a second time.
    shapes = {tuple(p.shape) for p in params.values()}
    assert not [g for g in census.groups if g.key.shape in shapes and g.key.category == "other"]
    assert census.errors == 0
