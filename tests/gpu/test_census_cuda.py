"""The census on real CUDA tensors: device keys and invisible bytes from the real allocator."""

from __future__ import annotations

import gc

import torch
from torch import nn

from gpumemd.probes.census.census_steps import take_census
from gpumemd.probes.device.allocator import AllocatorProbe
from gpumemd.records.device import Device


def test_cuda_parameters_are_counted_and_invisible_bytes_are_what_autograd_keeps() -> None:
    gc.collect()
    model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Dropout(0.5), nn.Linear(1024, 1)).cuda()
    opt = torch.optim.Adam(model.parameters())
    x = torch.randn(512, 256, device="cuda")
    model(x).sum().backward()
    opt.step()
    kept = [model(x).pow(2).mean()]  # a live graph: the dropout mask lives only in autograd
    torch.cuda.synchronize()
    allocator = AllocatorProbe().read()

    census = take_census(models=[model], optimizers=[opt], holders=0, allocator=allocator)

    params = dict(model.named_parameters())
    for fqn, p in params.items():
        [group] = census.groups_named(fqn)
        assert group.key.device == Device.cuda(0) and group.nbytes == p.numel() * 4
    invisible = census.invisible_bytes_by_device[Device.cuda(0)]
    # The census's own estimate of the graph (saved tensors no Python object holds) accounts for
    # most of what the allocator has beyond the visible storages (rounding to 512-byte blocks aside).
    assert census.graph_retained_bytes > 0
    assert invisible >= census.graph_retained_bytes * 0.9
    del kept

