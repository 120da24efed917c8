"""Allocation sites from snapshots in exactly torch's ``_snapshot()`` format (TORCH_MEMORY_API.md §2.2)."""

from __future__ import annotations

from typing import Any

from gpumemd.analysis.alloc_sites import NO_STACK, first_user_frame, live_by_site, site_growth, site_sentence

TORCH_FRAMES = [
    {"filename": "/usr/lib/python3.11/site-packages/torch/nn/modules/linear.py", "line": 125, "name": "forward"},
    {"filename": "/usr/lib/python3.11/site-packages/torch/nn/modules/module.py", "line": 1775, "name": "_call_impl"},
]
INTERNAL = ("/usr/lib/python3.11/site-packages/torch/", "/usr/lib/python3.11/")  # as package_dirs gives them
CPP_FRAME = {"filename": "/pytorch/c10/cuda/CUDACachingAllocator.cpp", "line": 1200, "name": "malloc"}


def frames(line: int, fn: str = "main") -> list[dict[str, Any]]:
    return [CPP_FRAME, *TORCH_FRAMES, {"filename": "/home/me/train.py", "line": line, "name": fn},
            {"filename": "/home/me/train.py", "line": 200, "name": "<module>"}]


def block(size: int, state: str = "active_allocated", fr: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"address": 0, "size": size, "requested_size": size, "state": state, "frames": fr or []}


def snapshot(blocks: list[dict[str, Any]], device: int = 0) -> dict[str, Any]:
    total = sum(b["size"] for b in blocks)
    return {
        "segments": [{
            "device": device, "address": 139_000_000_000, "total_size": total,
            "allocated_size": sum(b["size"] for b in blocks if b["state"] == "active_allocated"),
            "active_size": total, "requested_size": total, "stream": 0, "segment_type": "large",
            "segment_pool_id": (0, 0), "is_expandable": False, "frames": [], "blocks": blocks,
        }],
        "device_traces": [[]],
        "allocator_settings": {"expandable_segments": False},
    }


def test_first_user_frame_skips_cpp_torch_and_pseudo_files() -> None:
    assert first_user_frame(frames(57), INTERNAL) == "train.py:57 in main"
    assert first_user_frame([{"filename": "<frozen runpy>", "line": 1, "name": "x"}]) is None
    assert first_user_frame([]) is None


def test_live_blocks_grouped_by_site_and_diffed() -> None:
    params = block(4 << 20, fr=frames(20, "build"))
    before = snapshot([params, block(2 << 20, fr=frames(57)), block(1 << 20, "inactive"), block(512)])
    after = snapshot([params] + [block(2 << 20, fr=frames(57))] * 11 + [block(1 << 20, "active_pending_free",
                     frames(80)), block(512)])
    live = live_by_site(after, internal=INTERNAL)
    assert live["train.py:57 in main"].bytes == 11 * (2 << 20)
    assert live["train.py:57 in main"].count == 11
    assert live[NO_STACK].bytes == 512  # blocks without history are grouped, not dropped
    assert "train.py:80 in main" not in live  # pending-free is not live
    growth = site_growth(before, after, internal=INTERNAL)
    assert [(d.site, d.count_delta, d.bytes_delta) for d in growth] == [("train.py:57 in main", 10, 10 * (2 << 20))]
    assert site_sentence(growth[0], 10) == "train.py:57 in main (+10 blocks, +2.0 MiB/step)"


def test_device_filter_and_bare_segment_list() -> None:
    s0 = snapshot([block(1024, fr=frames(1))], device=0)
    s1 = snapshot([block(2048, fr=frames(2))], device=1)
    both = s0["segments"] + s1["segments"]  # what torch.cuda.memory_snapshot() returns
    assert set(live_by_site(both, internal=INTERNAL)) == {"train.py:1 in main", "train.py:2 in main"}
    assert set(live_by_site(both, device=1, internal=INTERNAL)) == {"train.py:2 in main"}


def test_a_users_folder_named_like_a_package_is_user_code() -> None:
    """"/torch/" and "/gpumemd/" as substrings hid user code in folders of those
    names (this repository's checkout on a CI runner); only the real package directories are internal."""
    user = [{"filename": "/builds/gpumemd/torch/train.py", "line": 9, "name": "step"}]
    assert first_user_frame([*TORCH_FRAMES, *user], INTERNAL) == "train.py:9 in step"


def test_internal_dirs_are_the_installed_packages_and_the_stdlib() -> None:
    import os
    import sysconfig

    import torch

    import gpumemd
    from gpumemd.probes.package_dirs import internal_dirs

    dirs = internal_dirs()
    for module in (torch, gpumemd):
        assert os.path.dirname(module.__file__).replace("\\", "/") + "/" in dirs
    assert sysconfig.get_paths()["stdlib"].replace("\\", "/") + "/" in dirs
    here = {"filename": os.path.abspath(__file__), "line": 1, "name": "t"}  # tests/ is not gpumemd/
    inside = {"filename": os.path.join(os.path.dirname(torch.__file__), "nn", "functional.py"), "line": 1, "name": "f"}
    assert first_user_frame([inside, here], dirs) == f"{os.path.basename(__file__)}:1 in t"
