"""The memory limits a job really runs under, read from fake cgroup trees laid out as the kernel writes
them (``/proc/self/cgroup``, ``/proc/self/mountinfo``, the controller's files), and the headroom, the
breakdown, the exporter and ``doctor`` built from them."""

from __future__ import annotations

import resource
from pathlib import Path

import pytest

from gpumemd.analysis.breakdown import cpu_breakdown
from gpumemd.doctor.host_checks import check_memory_limits
from gpumemd.probes.process import host_limits
from gpumemd.probes.process.host import HostProbe
from gpumemd.probes.process.host_limits import CgroupMemory, binding, rlimits
from gpumemd.records.oom import OomMessage
from gpumemd.records.samples import HostLimit, HostSample
from gpumemd.report.view import host_words, item_label, total_axis_label

GiB, MiB = 1024**3, 1024**2
V1_UNLIMITED = "9223372036854771712"  # PAGE_COUNTER_MAX pages of 4 KiB: what v1 writes for "no limit"

V2_MOUNT = "35 24 0:30 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:9 - cgroup2 cgroup2 rw,nsdelegate\n"
V1_MOUNTS = (
    "31 23 0:28 / /sys/fs/cgroup ro,nosuid,nodev,noexec shared:9 - tmpfs tmpfs ro,mode=755\n"
    "32 31 0:29 {root} /sys/fs/cgroup/cpu,cpuacct rw,nosuid shared:10 - cgroup cgroup rw,cpu,cpuacct\n"
    "35 31 0:32 {root} /sys/fs/cgroup/memory rw,nosuid,nodev,noexec,relatime shared:13 - cgroup cgroup rw,memory\n"
    "41 31 0:38 / /sys/fs/cgroup/unified rw,nosuid shared:19 - cgroup2 cgroup2 rw,nsdelegate\n"
)


def v2_stat(inactive_file: int) -> str:
    return (f"anon 1048576\nfile {inactive_file + 4096}\nkernel 262144\nshmem 0\nactive_anon 0\n"
            f"inactive_anon 1048576\nactive_file 4096\ninactive_file {inactive_file}\nunevictable 0\n")


def v1_stat(inactive_file: int) -> str:
    return (f"cache {inactive_file}\nrss 1048576\nhierarchical_memory_limit {V1_UNLIMITED}\n"
            f"inactive_file {inactive_file // 2}\ntotal_cache {inactive_file}\n"
            f"total_inactive_file {inactive_file}\ntotal_active_file 0\n")


def write(root: Path, path: str, text: str) -> None:
    target = root / path.lstrip("/")
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text)


def v2_tree(root: Path, member: str, levels: dict[str, tuple[str, int, int]]) -> Path:
    """A cgroup v2 tree: the process in ``member``; ``levels``: cgroup path -> (memory.max, memory.current,
    inactive_file). The top cgroup has no memory.max, as on a real host."""
    write(root, "/proc/self/cgroup", f"0::{member}\n")
    write(root, "/proc/self/mountinfo", "22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw\n" + V2_MOUNT)
    write(root, "/sys/fs/cgroup/memory.stat", v2_stat(0))
    write(root, "/sys/fs/cgroup/cgroup.controllers", "cpuset cpu io memory pids\n")
    for path, (limit, current, inactive) in levels.items():
        base = "/sys/fs/cgroup" + path
        write(root, base + "/memory.max", f"{limit}\n")
        write(root, base + "/memory.current", f"{current}\n")
        write(root, base + "/memory.stat", v2_stat(inactive))
    return root


def test_v2_container_limit_less_its_working_set(tmp_path: Path) -> None:
    # A container with its own cgroup namespace: /proc/self/cgroup says "0::/", its cgroup is the mount's root.
    v2_tree(tmp_path, "/", {"": ("2147483648", 1536 * MiB, 512 * MiB)})

    cgroup = CgroupMemory(str(tmp_path))

    assert cgroup.version == 2 and cgroup.path == str(tmp_path / "sys/fs/cgroup")
    # inactive page cache is reclaimed before the kernel kills: it is not counted as used (as the kubelet)
    assert cgroup.read() == HostLimit("cgroup", 2 * GiB, 1024 * MiB)
    assert cgroup.binding_file == str(tmp_path / "sys/fs/cgroup/memory.max")


def test_v2_the_tightest_ancestor_binds(tmp_path: Path) -> None:
    # Kubernetes sets the pod's limit on the pod cgroup; the container's own may be "max" or larger.
    pod = "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1a2b.slice"
    container = pod + "/cri-containerd-3f9c.scope"
    v2_tree(tmp_path, container, {
        "/kubepods.slice": ("max", 40 * GiB, 0),
        pod: (str(4 * GiB), 3 * GiB, 0),
        container: ("max", 3 * GiB - 5 * MiB, 0),
    })

    cgroup = CgroupMemory(str(tmp_path))

    assert cgroup.path == str(tmp_path / "sys/fs/cgroup" / container.lstrip("/"))
    assert len(cgroup.files) == 3  # read at each sample: the container's, the pod's, kubepods'
    assert cgroup.read() == HostLimit("cgroup", 4 * GiB, 3 * GiB)
    assert cgroup.binding_file is not None and cgroup.binding_file.endswith("pod1a2b.slice/memory.max")


def test_v2_slurm_job_limit_binds_its_steps(tmp_path: Path) -> None:
    job = "/system.slice/slurmstepd.scope/job_4242"
    task = job + "/step_0/user/task_0"
    v2_tree(tmp_path, task, {job: (str(16 * GiB), 15 * GiB, GiB // 2), task: ("max", 14 * GiB, 0)})

    assert CgroupMemory(str(tmp_path)).read() == HostLimit("cgroup", 16 * GiB, 15 * GiB - GiB // 2)


def test_v2_without_a_limit_is_none(tmp_path: Path) -> None:
    v2_tree(tmp_path, "/user.slice/user-1000.slice/session-3.scope",
            {"/user.slice/user-1000.slice/session-3.scope": ("max", 300 * MiB, 0)})

    cgroup = CgroupMemory(str(tmp_path))

    assert cgroup.version == 2 and cgroup.read() is None


@pytest.mark.parametrize("namespaced", [True, False])
def test_v1_docker_limit_and_the_unlimited_sentinel(tmp_path: Path, namespaced: bool) -> None:
    # Docker on cgroup v1: the memory hierarchy's root as the container sees it is /docker/<id>, or
    # (no namespace) the full path is under the host's mount.
    cid = "/docker/0123abcd"
    write(tmp_path, "/proc/self/cgroup", f"12:pids:{cid}\n11:memory:{cid}\n4:cpu,cpuacct:{cid}\n0::/\n")
    write(tmp_path, "/proc/self/mountinfo", V1_MOUNTS.format(root=cid if namespaced else "/"))
    base = "/sys/fs/cgroup/memory" + ("" if namespaced else cid)
    write(tmp_path, base + "/memory.limit_in_bytes", f"{GiB}\n")
    write(tmp_path, base + "/memory.usage_in_bytes", f"{900 * MiB}\n")
    write(tmp_path, base + "/memory.stat", v1_stat(100 * MiB))
    if not namespaced:
        write(tmp_path, "/sys/fs/cgroup/memory/memory.limit_in_bytes", V1_UNLIMITED + "\n")
        write(tmp_path, "/sys/fs/cgroup/memory/memory.usage_in_bytes", f"{20 * GiB}\n")

    cgroup = CgroupMemory(str(tmp_path))

    assert cgroup.version == 1  # the unified mount of a hybrid host has no memory files: v1 is in use
    assert cgroup.read() == HostLimit("cgroup", GiB, 800 * MiB)
    write(tmp_path, base + "/memory.limit_in_bytes", V1_UNLIMITED + "\n")  # the limit lifted while running
    assert cgroup.read() is None


def test_no_cgroup_at_all_is_absent_never_an_error(tmp_path: Path) -> None:
    cgroup = CgroupMemory(str(tmp_path))  # no /proc/self/cgroup: not Linux, or /proc not mounted

    assert cgroup.version is None and cgroup.read() is None


def test_a_cgroup_file_gone_mid_run_leaves_the_others(tmp_path: Path) -> None:
    v2_tree(tmp_path, "/a/b", {"/a": (str(8 * GiB), GiB, 0), "/a/b": (str(4 * GiB), GiB, 0)})
    cgroup = CgroupMemory(str(tmp_path))
    (tmp_path / "sys/fs/cgroup/a/b/memory.current").unlink()

    assert cgroup.read() == HostLimit("cgroup", 8 * GiB, GiB)


def test_rlimits_against_the_process_size(monkeypatch: pytest.MonkeyPatch) -> None:
    limits = {resource.RLIMIT_AS: (5 * GiB, resource.RLIM_INFINITY),
              resource.RLIMIT_DATA: (resource.RLIM_INFINITY, resource.RLIM_INFINITY)}
    monkeypatch.setattr(host_limits.resource, "getrlimit", limits.__getitem__)

    assert rlimits(3 * GiB, GiB) == [HostLimit("rlimit_as", 5 * GiB, 3 * GiB)]


def test_the_least_headroom_binds() -> None:
    ram = HostLimit("ram", 64 * GiB, 10 * GiB)
    cgroup = HostLimit("cgroup", 8 * GiB, 7 * GiB)
    assert binding([ram, cgroup, HostLimit("rlimit_as", 100 * GiB, 90 * GiB)]) is cgroup
    assert binding([]) is None
    assert HostLimit("cgroup", GiB, 2 * GiB).headroom_bytes == 0  # over the limit (reclaiming): no room


def test_the_host_probe_reports_the_binding_limit(tmp_path: Path) -> None:
    v2_tree(tmp_path, "/", {"": (str(512 * MiB), 412 * MiB, 0)})  # 100 MiB left: less than any CI host's RAM
    probe = HostProbe(pinned_fn=lambda: None, root=str(tmp_path))
    try:
        sample = probe.read()
    finally:
        probe.close()

    assert sample is not None
    assert (sample.limit, sample.available_bytes, sample.total_bytes) == ("cgroup", 100 * MiB, 512 * MiB)
    assert [limit.kind for limit in sample.limits][:2] == ["ram", "cgroup"]  # every limit, for the exporter


def test_growth_since_the_reading_comes_out_of_the_headroom() -> None:
    sampled = HostSample(rss_bytes=GiB, available_bytes=500 * MiB, total_bytes=2 * GiB, limit="cgroup")

    assert sampled.with_rss(GiB + 120 * MiB).available_bytes == 380 * MiB
    assert sampled.with_rss(GiB - 300 * MiB).available_bytes == 500 * MiB  # a shrink waits for the next reading
    assert sampled.with_rss(3 * GiB).available_bytes == 0
    assert sampled.with_rss(GiB).limit == "cgroup"


def test_breakdown_and_report_name_the_cgroup_limit() -> None:
    host = HostSample(rss_bytes=1800 * MiB, available_bytes=50 * MiB, total_bytes=2 * GiB, limit="cgroup")
    b = cpu_breakdown(message=OomMessage(kind="cpu", format="cpu", requested_bytes=64 * MiB), host=host)

    assert b.host_limit == "cgroup" and b.total_bytes == 2 * GiB
    assert b.verdict == "capacity" and "left under the cgroup memory limit" in b.verdict_why
    assert b.get("non_pytorch") == 2 * GiB - 50 * MiB - 1800 * MiB
    report = {"device": "cpu", "total_bytes": b.total_bytes, "host_limit": b.host_limit}
    assert host_words(report).startswith("Host limit: the cgroup memory limit, 2.00 GiB")
    assert total_axis_label(report) == "cgroup limit"
    assert item_label({"key": "free"}, "cpu", "cgroup") == "left under the cgroup memory limit"


def test_host_ram_is_called_host() -> None:
    host = HostSample(rss_bytes=GiB, available_bytes=20 * GiB, total_bytes=24 * GiB, limit="ram")
    b = cpu_breakdown(message=OomMessage(kind="cpu", format="cpu", requested_bytes=2**60), host=host)
    report = {"device": "cpu", "total_bytes": b.total_bytes, "host_limit": b.host_limit}

    assert "larger than the host's 24.00 GiB of RAM" in b.verdict_why
    assert host_words(report) == "Host RAM: 24.00 GiB" and total_axis_label(report) == "host RAM"
    assert item_label({"key": "free"}, "cpu", "ram") == "available on the host"


def test_doctor_names_the_binding_cgroup_file(tmp_path: Path) -> None:
    v2_tree(tmp_path, "/job", {"/job": (str(256 * MiB), 200 * MiB, 0)})

    check = check_memory_limits(str(tmp_path))

    cgroup_file = tmp_path / "sys/fs/cgroup/job/memory.max"
    assert check.detail.startswith(f"bound by the cgroup memory limit ({cgroup_file}): 56.0 MiB left of 256.0 MiB")
    assert "the host's RAM" in check.detail
