"""Allocation sites from snapshots in exactly torch's ``_snapshot()`` format (TORCH_MEMORY_API.md §2.2)."""

from __future__ import annotations

from typing import Any

from gpumemd.analysis.alloc_sites import NO_STACK, diff_sites, first_user_frame, live_by_site, site_sentence

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
    growth = diff_sites(live_by_site(before, internal=INTERNAL), live)
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


def test_internal_dirs_are_torch_and_gpumemd_and_library_dirs_the_stdlib_and_packages() -> None:
    import os
    import sysconfig

    import torch

    import gpumemd
    from gpumemd.probes.holding.package_dirs import internal_dirs, library_dirs

    dirs = internal_dirs()
    for module in (torch, gpumemd):
        assert os.path.dirname(module.__file__).replace("\\", "/") + "/" in dirs
    # in a venv, conda or a python:3.x image the stdlib dirs hold site-packages: never internal
    assert sysconfig.get_paths()["stdlib"].replace("\\", "/") + "/" not in dirs
    assert sysconfig.get_paths()["stdlib"].replace("\\", "/") + "/" in library_dirs()
    assert sysconfig.get_paths()["purelib"].replace("\\", "/") + "/" in library_dirs()
    here = {"filename": os.path.abspath(__file__), "line": 1, "name": "t"}  # tests/ is not gpumemd/
    inside = {"filename": os.path.join(os.path.dirname(torch.__file__), "nn", "functional.py"), "line": 1, "name": "f"}
    assert first_user_frame([inside, here], dirs, library_dirs()) == f"{os.path.basename(__file__)}:1 in t"


SITE = "/opt/conda/lib/python3.11/site-packages/"
LIBRARY = ("/opt/conda/lib/python3.11/", SITE)  # as package_dirs gives them: the stdlib and site-packages
CONDA_INTERNAL = (SITE + "torch/",)
HF = {"filename": SITE + "transformers/models/llama/modeling_llama.py", "line": 321, "name": "forward"}
TRAINER = {"filename": SITE + "transformers/trainer.py", "line": 2241, "name": "train"}
USER = {"filename": "/home/me/train.py", "line": 57, "name": "main"}
TORCH_IN_CONDA = {"filename": SITE + "torch/nn/modules/module.py", "line": 1775, "name": "_call_impl"}


def test_a_library_frame_is_the_site_and_the_users_line_is_shown_beside_it() -> None:
    stack = [CPP_FRAME, TORCH_IN_CONDA, HF, TORCH_IN_CONDA, TRAINER, USER]
    assert first_user_frame(stack, CONDA_INTERNAL, LIBRARY) == (
        "modeling_llama.py:321 in forward, called from train.py:57 in main")
    # no user frame at all (a library's own entry point): the library frame alone
    alone = first_user_frame([TORCH_IN_CONDA, HF, TRAINER], CONDA_INTERNAL, LIBRARY)
    assert alone == "modeling_llama.py:321 in forward"
    live = live_by_site(snapshot([block(1 << 20, fr=stack)]), internal=CONDA_INTERNAL, library=LIBRARY)
    assert list(live) == ["modeling_llama.py:321 in forward, called from train.py:57 in main"]


def test_user_code_installed_as_a_package_is_not_hidden() -> None:
    mine = {"filename": SITE + "mytrainer/loop.py", "line": 88, "name": "step"}
    assert first_user_frame([TORCH_IN_CONDA, mine], CONDA_INTERNAL, LIBRARY) == "loop.py:88 in step"


def test_inductor_generated_code_is_not_user_code_and_fx_traces_name_the_models_line() -> None:
    generated = {"filename": "/tmp/torchinductor_me/ab/cabc123.py", "line": 40, "name": "call"}
    assert first_user_frame([CPP_FRAME, generated, TORCH_IN_CONDA, USER], CONDA_INTERNAL, LIBRARY) == \
        "train.py:57 in main"
    fx = {"filename": "/tmp/fx_generated_xyz.py", "line": 7, "name": "forward", "fx_node_op": "call_function",
          "fx_original_trace": '  File "/home/me/train.py", line 57, in main\n    loss = model(x)\n'
                               '  File "/home/me/model.py", line 12, in forward\n    h = self.proj(x)\n'}
    assert first_user_frame([CPP_FRAME, fx, TORCH_IN_CONDA, USER], CONDA_INTERNAL, LIBRARY) == "model.py:12 in forward"
