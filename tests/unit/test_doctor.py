"""``gpumemd doctor``: on this real CPU machine through ``main``, and with fake torch/NVML modules for the
CUDA, allocator, history and container (PID namespace) cases this machine cannot show."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from gpumemd import doctor
from gpumemd.cli import main
from gpumemd.doctor.allocator_checks import parse_alloc_conf
from gpumemd.doctor.check import Check, failed_needed
from gpumemd.doctor.torch_checks import TorchImport

GIB = 2**30


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The caller's GPUMEMD_* and allocator settings must not change what these tests see."""
    for key in list(os.environ):
        if key.startswith(("GPUMEMD_", "PYTORCH_")) or key in ("LOCAL_RANK", "RANK", "CUDA_VISIBLE_DEVICES"):
            monkeypatch.delenv(key)


def doctor_lines(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict[str, list[str]], str]:
    """(exit code, status+detail lines by check name, the verdict line)."""
    code = main(["doctor", *argv])
    captured = capsys.readouterr()
    assert captured.err == ""  # everything doctor says is on stdout: no traceback, no stray warning
    lines = captured.out.strip().splitlines()
    by_name: dict[str, list[str]] = {}
    for line in lines[:-1]:
        status, rest = line[:4].strip(), line[6:]
        name = next(c for c in _NAMES if rest.startswith(c + " "))
        by_name.setdefault(name, []).append(f"{status} {rest[len(name):].strip()}")
    return code, by_name, lines[-1]


_NAMES = sorted(["gpumemd", "config", "torch", "numpy", "cuda", "device count", "allocator", "expandable segments",
                 "allocation history", "nvml process", "nvml", "psutil", "memory limits", "prometheus_client",
                 "output dir", "metrics port", "lightning", "pytorch-lightning", "transformers", "accelerate"],
                key=len, reverse=True)  # "nvml process" before "nvml"


# --- this machine: CPU-only torch, no NVIDIA driver ----------------------------------------------


def test_cpu_machine_everything_needed_works(capsys: pytest.CaptureFixture[str], tmp_path: Any) -> None:
    code, lines, verdict = doctor_lines(capsys, "--output-dir", str(tmp_path / "out"))
    assert code == 0
    assert verdict.startswith("everything gpumemd needs works")
    assert lines["torch"][0].startswith("ok ") and "CPU-only build" in lines["torch"][0]
    assert lines["cuda"][0].startswith("n/a ")
    assert lines["nvml"][0].startswith("n/a ")  # no driver: NVML absent, not needed
    assert lines["output dir"][0].startswith("ok ") and "does not exist yet" in lines["output dir"][0]
    assert not (tmp_path / "out").exists()  # doctor never creates the directory
    assert os.listdir(tmp_path) == []  # nor leaves its probe file behind
    assert lines["metrics port"][0].startswith("n/a ")
    assert lines["memory limits"][0].startswith("ok bound by ")  # the limit host headroom is measured in


def test_json_parses_and_is_ok(capsys: pytest.CaptureFixture[str], tmp_path: Any) -> None:
    assert main(["doctor", "--json", "--output-dir", str(tmp_path), "--port", "0"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] is True
    by_name = {c["name"]: c for c in doc["checks"]}
    assert set(by_name["torch"]) == {"name", "status", "detail", "needed"}
    assert by_name["torch"]["needed"] is True and by_name["nvml"]["needed"] is False
    assert by_name["metrics port"]["status"] == "ok" and "port 0" in by_name["metrics port"]["detail"]
    assert os.listdir(tmp_path) == []


def test_unwritable_output_dir_fails_naming_it(capsys: pytest.CaptureFixture[str], tmp_path: Any) -> None:
    blocker = tmp_path / "file.txt"
    blocker.write_text("a file, not a directory")
    code, lines, verdict = doctor_lines(capsys, "--output-dir", str(blocker / "sub"))
    assert code == 1  # under a regular file: fails for root too
    assert lines["output dir"][0].startswith("fail ") and str(blocker / "sub") in lines["output dir"][0]
    assert verdict == "1 needed check(s) failed: output dir"


def test_port_in_use_fails_naming_it(capsys: pytest.CaptureFixture[str], tmp_path: Any) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        code, lines, verdict = doctor_lines(capsys, "--output-dir", str(tmp_path), "--port", str(port))
    assert code == 1
    assert lines["metrics port"][0].startswith("fail ")
    assert f"127.0.0.1:{port} is already in use" in lines["metrics port"][0]
    assert "metrics port" in verdict


def test_port_adds_local_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("RANK", "3")
    checks = doctor._config_dependent({"output_dir": ".", "port": 65534, "bind": "127.0.0.1"}, os.environ)
    port = next(c for c in checks if c.name == "metrics port")
    assert port.status == "fail" and "65537 (port 65534 + LOCAL_RANK 3)" in port.detail


def test_bad_env_value_is_a_failed_check(capsys: pytest.CaptureFixture[str], tmp_path: Any,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUMEMD_PORT", "abc")
    code, lines, verdict = doctor_lines(capsys, "--output-dir", str(tmp_path))
    assert code == 1
    assert lines["config"][0] == "fail GPUMEMD_PORT='abc' is not valid: expected an integer"
    assert lines["metrics port"][0].startswith("n/a ")  # not checked with a value that is not one
    assert lines["output dir"][0].startswith("ok ")  # the other fields are still checked
    assert verdict == "1 needed check(s) failed: config"


def test_bad_option_value_names_the_option(capsys: pytest.CaptureFixture[str], tmp_path: Any) -> None:
    code, lines, _ = doctor_lines(capsys, "--output-dir", str(tmp_path), "--bind", "localhost")
    assert code == 1
    assert lines["config"][0].startswith("fail --bind='localhost' is not valid: expected an IP address")


def test_misspelled_variable_suggests_the_right_one(capsys: pytest.CaptureFixture[str], tmp_path: Any,
                                                    monkeypatch: pytest.MonkeyPatch,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("GPUMEMD_PROT", "9400")
    code, lines, _ = doctor_lines(capsys, "--output-dir", str(tmp_path))
    assert code == 0  # a warning, not a failure: another tool may share the prefix
    assert "warn GPUMEMD_PROT is not a gpumemd option (did you mean GPUMEMD_PORT?); ignored" in lines["config"]
    assert not caplog.records  # said once, as a doctor line, not also logged by Config.from_sources


def test_an_old_variable_name_is_checked_and_a_warning(capsys: pytest.CaptureFixture[str], tmp_path: Any,
                                                      monkeypatch: pytest.MonkeyPatch,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("GPUMEMD_HISTORY_STEPS", "0")
    code, lines, _ = doctor_lines(capsys, "--output-dir", str(tmp_path))
    assert code == 1
    assert lines["config"][0] == "fail GPUMEMD_HISTORY_STEPS=0 is not valid: expected an integer from 1 to 10,000,000"
    assert "warn GPUMEMD_HISTORY_STEPS is deprecated; use GPUMEMD_KEEP_STEPS (same meaning)" in lines["config"]
    assert not caplog.records  # said once, as a doctor line


def test_usage_error_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", "--no-such-option"]) == 2
    assert main(["doctor", "--help"]) == 0
    assert "1 when a needed check fails" in " ".join(capsys.readouterr().out.split())


def test_numpy_warning_of_torch_import_becomes_a_line(tmp_path: Any) -> None:
    """With NumPy unimportable, torch warns "Failed to initialize NumPy" on import: a numpy line says so
    and stderr stays clean. In a subprocess: torch must be imported fresh."""
    code = ("import sys; sys.modules['numpy'] = None\nfrom gpumemd.cli import main\n"
            "sys.exit(main(['doctor', '--json', '--output-dir', sys.argv[1]]))")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True,
                         env={k: v for k, v in os.environ.items() if not k.startswith("GPUMEMD_")})
    assert out.returncode == 0, out.stderr
    assert "Failed to initialize NumPy" not in out.stderr
    numpy = next(c for c in json.loads(out.stdout)["checks"] if c["name"] == "numpy")
    assert numpy["status"] == "warn" and "Failed to initialize NumPy" in numpy["detail"]
    assert "Triggered internally" not in numpy["detail"]


# --- fakes: CUDA devices, allocator backend, history, NVML, containers ----------------------------


def fake_torch(*, backend: str = "native", history: bool = False, devices: int = 2) -> Any:
    """The attributes doctor reads from torch, shaped like a CUDA 12.4 build of torch 2.5."""
    props = [SimpleNamespace(name="NVIDIA H100 80GB HBM3", total_memory=80 * GIB) for _ in range(devices)]
    made: list[str] = []
    return SimpleNamespace(
        __version__="2.5.1+cu124",
        version=SimpleNamespace(cuda="12.4", hip=None),
        backends=SimpleNamespace(cuda=SimpleNamespace(is_built=lambda: True)),
        cuda=SimpleNamespace(
            is_available=lambda: devices > 0,
            device_count=lambda: devices,
            get_device_properties=lambda i: props[i],
            memory=SimpleNamespace(get_allocator_backend=lambda: backend),
        ),
        _C=SimpleNamespace(_cuda_isHistoryEnabled=lambda: history),
        ones=lambda n, device: made.append(device) or SimpleNamespace(device=device),
        made=made,  # where doctor created its context tensor
    )


class NVMLError_DriverNotLoaded(Exception):  # pynvml's own class name, so the detail reads as on a real machine
    pass


def fake_nvml(pids: list[int] | None = None, *, init_error: Exception | None = None) -> Any:
    """nvidia-ml-py's ``pynvml`` calls doctor makes; device 0 runs ``pids`` (MiB each: 512)."""
    def init() -> None:
        if init_error is not None:
            raise init_error

    procs = [SimpleNamespace(pid=p, usedGpuMemory=512 * 2**20) for p in (pids or [])]
    return SimpleNamespace(
        nvmlInit=init,
        nvmlShutdown=lambda: None,
        nvmlSystemGetDriverVersion=lambda: "550.54.15",
        nvmlDeviceGetCount=lambda: 2,
        nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetComputeRunningProcesses=lambda handle: procs if handle == 0 else [],
    )


def test_fake_cuda_devices_are_listed() -> None:
    torch = fake_torch()
    assert doctor.check_torch(torch) == Check("torch", "ok", "2.5.1+cu124, CUDA 12.4 build", needed=True)
    cuda = doctor.check_cuda(torch, {})
    assert cuda.status == "ok"
    assert cuda.detail == "2 devices: 0 NVIDIA H100 80GB HBM3 (80.0 GiB), 1 NVIDIA H100 80GB HBM3 (80.0 GiB)"


def test_old_or_missing_torch_fails_as_needed() -> None:
    old = doctor.check_torch(SimpleNamespace(__version__="2.0.1", version=SimpleNamespace(cuda=None)))
    assert old.status == "fail" and old.needed and "older than 2.1" in old.detail
    missing = doctor.check_torch(None, "ModuleNotFoundError: No module named 'torch'")
    assert missing.status == "fail" and "No module named 'torch'" in missing.detail


def test_cuda_build_without_device_warns() -> None:
    cuda = doctor.check_cuda(fake_torch(devices=0), {"CUDA_VISIBLE_DEVICES": ""})
    assert cuda.status == "warn" and "sees no device" in cuda.detail and "CUDA_VISIBLE_DEVICES=''" in cuda.detail


def test_cuda_malloc_async_and_expandable_segments() -> None:
    env = {"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync,expandable_segments:True"}
    allocator, expandable = doctor.check_allocator(fake_torch(backend="cudaMallocAsync"), env)
    assert allocator.status == "warn" and not allocator.needed
    assert allocator.detail.startswith("cudaMallocAsync (PYTORCH_CUDA_ALLOC_CONF): only allocated, active and "
                                       "reserved bytes")
    assert "no snapshots, allocation history or OOM observer" in allocator.detail
    assert expandable.status == "n/a" and "native allocator only" in expandable.detail


def test_native_allocator_with_expandable_segments() -> None:
    env = {"PYTORCH_ALLOC_CONF": "expandable_segments:True,roundup_power2_divisions:[64:8,>:1]"}
    allocator, expandable = doctor.check_allocator(fake_torch(), env)
    assert allocator.status == "ok" and allocator.detail.startswith("native caching allocator (PYTORCH_ALLOC_CONF)")
    assert expandable.status == "ok" and expandable.detail.startswith("on (PYTORCH_ALLOC_CONF): segments grow")
    off = doctor.check_allocator(fake_torch(), {})[1]
    assert off.status == "ok" and off.detail.startswith("off (the default)")


def test_two_differing_alloc_conf_variables_warn() -> None:
    env = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "PYTORCH_ALLOC_CONF": "expandable_segments:False"}
    allocator, _ = doctor.check_allocator(fake_torch(), env)
    assert allocator.status == "warn" and "PYTORCH_CUDA_ALLOC_CONF and PYTORCH_ALLOC_CONF are set and differ" \
        in allocator.detail


def test_parse_alloc_conf_keeps_bracketed_lists() -> None:
    assert parse_alloc_conf("max_split_size_mb:128, roundup_power2_divisions:[64:8,256:4],backend:native") \
        == {"max_split_size_mb": "128", "roundup_power2_divisions": "[64:8,256:4]", "backend": "native"}


def test_allocation_history() -> None:
    on = doctor.check_history(fake_torch(history=True))
    assert on.status == "ok" and on.detail.startswith("already on in this process")
    off = doctor.check_history(fake_torch(history=False))
    assert off.status == "ok" and off.detail.startswith("off")
    cpu = doctor.check_history(SimpleNamespace(_C=SimpleNamespace()))
    assert cpu.status == "n/a"


def test_nvml_lists_this_pid() -> None:
    main_line, process = doctor.check_nvml(fake_nvml([4242, 77]), 4242, torch_sees_cuda=True, has_context=True)
    assert main_line == Check("nvml", "ok", "driver 550.54.15, 2 devices")
    assert process.status == "ok"
    assert process.detail.startswith("NVML lists this process (pid 4242, 512.0 MiB on device 0)")


def test_nvml_lists_only_other_pids_in_a_container() -> None:
    _, process = doctor.check_nvml(fake_nvml([1001, 1002]), 7, torch_sees_cuda=True, has_context=True)
    assert process.status == "warn" and not process.needed
    assert "pid(s) 1001, 1002 but not this process (pid 7)" in process.detail
    assert "PID namespace, e.g. a container without --pid=host" in process.detail
    assert process.detail.endswith("per-process used memory will be absent")


def test_nvml_honours_cuda_visible_devices() -> None:
    main_line, _ = doctor.check_nvml(fake_nvml([5]), 5, visible="1", torch_sees_cuda=True, has_context=True)
    assert main_line.detail == "driver 550.54.15, 2 devices, 1 visible to this process (CUDA_VISIBLE_DEVICES='1')"


def test_nvml_init_failing_is_a_warning_not_needed() -> None:
    nvml = fake_nvml(init_error=NVMLError_DriverNotLoaded("Driver Not Loaded"))
    main_line, process = doctor.check_nvml(nvml, 1, torch_sees_cuda=True, has_context=True)
    assert main_line.status == "warn" and not main_line.needed
    assert main_line.detail.startswith("not available (NVMLError_DriverNotLoaded: Driver Not Loaded)")
    assert process.status == "n/a"
    absent = doctor.check_nvml(None, 1, torch_sees_cuda=True)[0]
    assert absent.status == "warn" and "pip install nvidia-ml-py" in absent.detail


def test_nvml_sees_gpus_that_a_cpu_torch_cannot_use() -> None:
    main_line, process = doctor.check_nvml(fake_nvml([]), 1, torch_sees_cuda=False)
    assert main_line.status == "warn" and "torch cannot use them" in main_line.detail
    assert process.status == "n/a" and "no CUDA context" in process.detail


@pytest.fixture
def fake_cuda_machine(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """``run_checks`` on a machine with 2 GPUs: NVML lists this pid only once a context exists."""
    torch = fake_torch(backend="native", history=False)
    procs: list[SimpleNamespace] = []
    nvml = fake_nvml()
    nvml.nvmlDeviceGetComputeRunningProcesses = lambda handle: (
        [SimpleNamespace(pid=os.getpid(), usedGpuMemory=2**29)] if torch.made and handle == 0 else procs)
    monkeypatch.setattr(doctor, "import_torch", lambda: TorchImport(torch, None, None))
    monkeypatch.setattr(doctor, "import_nvml", lambda: nvml)
    yield torch


def test_run_checks_creates_a_context_before_asking_nvml(capsys: pytest.CaptureFixture[str], tmp_path: Any,
                                                         fake_cuda_machine: Any) -> None:
    assert main(["doctor", "--json", "--output-dir", str(tmp_path)]) == 0
    checks = {c["name"]: c for c in json.loads(capsys.readouterr().out)["checks"]}
    assert fake_cuda_machine.made == ["cuda"]
    assert checks["cuda"]["status"] == "ok" and checks["cuda"]["detail"].startswith("2 devices")
    assert checks["allocator"]["status"] == "ok"
    assert checks["nvml process"]["status"] == "ok"


def test_a_check_that_raises_is_a_warning(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    def broken(*args: Any) -> Check:
        raise RuntimeError("driver exploded")

    assert doctor.guarded("cuda", False, broken) == [
        Check("cuda", "warn", "the check itself failed (RuntimeError: driver exploded)")]
    monkeypatch.setattr(doctor, "check_psutil", broken)
    psutil = next(c for c in doctor.run_checks({}, {"output_dir": str(tmp_path)}) if c.name == "psutil")
    assert psutil.status == "warn" and psutil.needed and not failed_needed([psutil])


def test_device_count_under_a_mig_list_says_it_poisons_fork() -> None:
    """torch 2.13's device_count() before CUDA init: NVML-based (fork-safe) unless CUDA_VISIBLE_DEVICES is
    a MIG- list or NVML cannot count; then cudaGetDeviceCount, which initialises CUDA in the process."""
    from types import SimpleNamespace

    from gpumemd.doctor.fork_checks import check_device_count

    cuda_build = SimpleNamespace(version=SimpleNamespace(cuda="12.8", hip=None))
    mig = check_device_count(cuda_build, {"CUDA_VISIBLE_DEVICES": "MIG-1b2c3d4e-0000-1111-2222-333344445555"},
                             nvml_counts=lambda: True)
    assert mig.status == "warn" and "cudaGetDeviceCount" in mig.detail and "forked" in mig.detail
    assert check_device_count(cuda_build, {"CUDA_VISIBLE_DEVICES": "0,1"}, nvml_counts=lambda: True).status == "ok"
    no_nvml = check_device_count(cuda_build, {}, nvml_counts=lambda: False)
    assert no_nvml.status == "warn" and "NVML" in no_nvml.detail
    assert check_device_count(cuda_build, {"CUDA_VISIBLE_DEVICES": ""}, nvml_counts=lambda: False).status == "ok"
    cpu = SimpleNamespace(version=SimpleNamespace(cuda=None, hip=None))
    assert check_device_count(cpu, {}).status == "n/a"


def test_gpumemd_leaves_the_device_count_alone_under_a_mig_list(monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    from gpumemd.probes.snapshots.snapshot import SnapshotProbe

    def count() -> int:
        raise AssertionError("device_count() under a MIG list initialises CUDA")

    torch_module = SimpleNamespace(version=SimpleNamespace(cuda="12.8", hip=None),
                                   cuda=SimpleNamespace(device_count=count))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-1b2c3d4e-0000-1111-2222-333344445555")
    assert SnapshotProbe(torch_module=torch_module).cuda_available() is True  # the lazy-init queue waits
