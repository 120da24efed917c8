"""CUDA ordinals matched to NVML devices by UUID once CUDA is up: CUDA's default
order is fastest first, NVML's is PCI bus order, so ``CUDA_VISIBLE_DEVICES`` alone (or nothing) can
name the wrong GPU on a mixed-GPU machine. Fake NVML in pynvml's call shapes: ``nvmlDeviceGetUUID``
returns ``str`` (``@convertStrBytes``), ``nvmlDeviceGetMigMode`` a ``[current, pending]`` list, and every
handle call a new object compared by identity (pynvml's ``c_nvmlDevice_t`` pointers)."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from fakes import FakeGpu, FakeNvml, NvmlError

from gpumemd.probes.device.nvml import NvmlProbe
from gpumemd.probes.device.nvml_devices import torch_cuda_uuid, uuid_key

GIB = 1 << 30
A = "6c8d9b1e-0f3a-4e2b-9a7c-1d2e3f405162"  # NVML index 0: the slower GPU, PCI bus first
B = "f00dbabe-1234-5678-9abc-def012345678"  # NVML index 1: the faster GPU, CUDA's ordinal 0
MIG1 = "0a1b2c3d-4e5f-6071-8293-a4b5c6d7e8f9"
MIG2 = "9f8e7d6c-5b4a-3928-1706-f5e4d3c2b1a0"


def node(gpus: list[tuple[str, int]], mig: dict[int, list[tuple[str, int]]] | None = None) -> FakeNvml:
    """MIG-capable GPUs given as (UUID, total GiB); ``mig`` maps a GPU index to its instances' (UUID, total GiB)."""
    instances = mig or {}
    return FakeNvml([FakeGpu(gib * GIB, uuid=f"GPU-{uuid}",
                             mig=[FakeGpu(g * GIB, uuid=f"MIG-{u}") for u, g in instances.get(i, [])])
                     for i, (uuid, gib) in enumerate(gpus)])


class CudaUuids:
    """The ``cuda_uuid`` seam: torch's spelling (bare 8-4-4-4-12, no ``GPU-``), calls counted."""

    def __init__(self, by_ordinal: dict[int, str | None], error: Exception | None = None) -> None:
        self.by_ordinal, self.error = by_ordinal, error
        self.calls: list[int] = []

    def __call__(self, ordinal: int) -> str | None:
        self.calls.append(ordinal)
        if self.error is not None:
            raise self.error
        return self.by_ordinal.get(ordinal)


@pytest.fixture
def no_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def totals(samples: tuple[Any, ...]) -> dict[int | None, int]:
    return {s.device.cuda_index: s.total_bytes // GIB for s in samples}


@pytest.mark.usefixtures("no_visible_devices")
def test_fastest_first_ordinal_reads_its_gpu_once_cuda_is_up(caplog: pytest.LogCaptureFixture) -> None:
    nvml = node([(A, 80), (B, 40)])
    uuids = CudaUuids({0: B, 1: A})
    probe = NvmlProbe(nvml=nvml, pid=1, cuda_uuid=uuids)
    assert totals(probe.read({0})) == {0: 80}  # before CUDA is up: NVML index 0, as the env says
    assert uuids.calls == []  # and CUDA is not asked
    with caplog.at_level(logging.INFO, logger="gpumemd"):
        assert totals(probe.read({0}, has_context=True)) == {0: 40}  # GPU B, CUDA's ordinal 0
        assert totals(probe.read(has_context=True)) == {0: 40, 1: 80}
        assert totals(probe.read({0})) == {0: 40}  # the match is a fact about this process: kept
    said = [r for r in caplog.records if "by UUID" in r.getMessage()]
    assert len(said) == 2 and all(r.levelno == logging.INFO for r in said)  # one line per matching pass
    assert "0 -> NVML GPU 1" in said[0].getMessage()
    assert probe.health.errors == 0


def test_mapping_computed_once_per_ordinal() -> None:
    nvml = node([(A, 80), (B, 40)])
    uuids = CudaUuids({0: B, 1: A})
    probe = NvmlProbe(nvml=nvml, pid=1, visible="0,1", cuda_uuid=uuids)
    for _ in range(5):
        probe.read({0}, has_context=True)
    assert uuids.calls == [0] and nvml.count_calls == 2  # _start's count, then one enumeration
    for _ in range(5):
        assert totals(probe.read({0, 1}, has_context=True)) == {0: 40, 1: 80}
    assert uuids.calls == [0, 1] and nvml.count_calls == 3  # ordinal 1 matched when first asked for


@pytest.mark.usefixtures("no_visible_devices")
def test_mig_instance_read_not_its_parent() -> None:
    nvml = node([(A, 80), (B, 80)], mig={1: [(MIG1, 10), (MIG2, 20)]})
    probe = NvmlProbe(nvml=nvml, pid=1, cuda_uuid=CudaUuids({0: MIG2}))
    assert totals(probe.read({0})) == {0: 80}
    assert totals(probe.read({0}, has_context=True)) == {0: 20}  # the instance's 20 GiB


@pytest.mark.parametrize(("instances", "env", "expected"), [
    ([(MIG1, 10)], None, 10),  # the parent's only instance
    ([(MIG1, 10), (MIG2, 20)], "MIG-9f8e", 20),  # the instance CUDA_VISIBLE_DEVICES names, on that parent
    ([(MIG1, 10), (MIG2, 20)], None, 80),  # which instance is unknown: the env's handle stays
])
def test_cuda_giving_the_mig_parents_uuid(monkeypatch: pytest.MonkeyPatch, instances: list[tuple[str, int]],
                                          env: str | None, expected: int) -> None:
    """Older drivers give CUDA the parent GPU's UUID for a MIG device; its 80 GiB are not ours."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    nvml = node([(A, 80), (B, 80)], mig={1: instances})
    probe = NvmlProbe(nvml=nvml, pid=1, visible=env, cuda_uuid=CudaUuids({0: B}))
    assert totals(probe.read({0}, has_context=True)) == {0: expected}


@pytest.mark.usefixtures("no_visible_devices")
@pytest.mark.parametrize("failure", ["raises", "none", "unknown", "nvml"])
def test_no_match_keeps_the_env_handle_said_once(caplog: pytest.LogCaptureFixture, failure: str) -> None:
    nvml = node([(A, 80), (B, 40)])
    uuids = CudaUuids({0: None if failure == "none" else MIG1 if failure == "unknown" else B},
                      error=RuntimeError("CUDA error: initialization error") if failure == "raises" else None)
    if failure == "nvml":
        nvml.uuid_error = NvmlError("GPU is lost")
    probe = NvmlProbe(nvml=nvml, pid=1, cuda_uuid=uuids)
    with caplog.at_level(logging.DEBUG, logger="gpumemd"):
        for _ in range(3):
            assert totals(probe.read({0}, has_context=True)) == {0: 80}
    assert uuids.calls == [0]
    said = [r for r in caplog.records if "not found by UUID" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.INFO
    assert not any(r.levelno >= logging.WARNING for r in caplog.records)
    assert probe.health.errors == 0 and probe.health.available


@pytest.mark.parametrize(("raw", "key"), [
    (f"GPU-{A}", A.replace("-", "")),
    (f"MIG-{MIG1}", MIG1.replace("-", "")),
    (A.upper(), A.replace("-", "")),  # torch's bare form, any case
    (f"GPU-{A}".encode(), A.replace("-", "")),  # an old binding's bytes
    (f"MIG-GPU-{A}/1/0", None),  # pre-R470 MIG names: no CUDA UUID equals them
    ("GPU-1aaaa", None),
    (None, None),
])
def test_uuid_spellings_compare_on_their_hex_digits(raw: Any, key: str | None) -> None:
    assert uuid_key(raw) == key


class CUuuid:
    """``torch._C._CUuuid``: ``str()`` is the 8-4-4-4-12 hex form, not a ``str`` itself."""

    def __str__(self) -> str:
        return B


def test_default_seam_reads_torch_only_once_cuda_is_initialised(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not torch.cuda.is_initialized()
    assert torch_cuda_uuid(0) is None  # CPU-only here: no answer, and CUDA stays uninitialised
    assert not torch.cuda.is_initialized()
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(uuid=CUuuid()))
    assert torch_cuda_uuid(0) == B
    probe = NvmlProbe(nvml=node([(A, 80), (B, 40)]), pid=1, visible="0")
    assert totals(probe.read({0}, has_context=True)) == {0: 40}
