"""CPUs a rank may use: the affinity mask capped by the cgroup CPU quota (v2 ``cpu.max``, v1 CFS files),
read from real files laid out as the kernel mounts them, and the affinity read in a real pinned process."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from workbench.cpu_quota import cgroup_cpu_limit, parse_cfs_quota, parse_cpu_max, threads_per_rank, usable_cpus

MODULE = Path(__file__).resolve().parents[1] / "workbench" / "cpu_quota.py"


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


@pytest.mark.parametrize("text,cpus", [
    ("max 100000\n", None),           # no limit
    ("200000 100000\n", 2.0),         # docker --cpus 2
    ("150000 100000\n", 1.5),
    ("50000 100000\n", 0.5),
    ("400000 200000\n", 2.0),         # another period
    ("100000\n", 1.0),                # period left out: the kernel's default 100000
])
def test_cpu_max_text_from_a_real_file(tmp_path, text, cpus):
    f = _write(tmp_path / "cpu.max", text)
    assert parse_cpu_max(f.read_text()) == cpus
    assert cgroup_cpu_limit(tmp_path, _write(tmp_path / "self-cgroup", "0::/\n")) == cpus


@pytest.mark.parametrize("text", ["", "fast 100000", "100000 100000 7", "0 100000", "-1 100000", "100000 0"])
def test_malformed_cpu_max_is_refused_by_the_parser_and_ignored_by_the_limit(tmp_path, text):
    f = _write(tmp_path / "cpu.max", text)
    with pytest.raises(ValueError):
        parse_cpu_max(f.read_text())
    assert cgroup_cpu_limit(tmp_path, _write(tmp_path / "self-cgroup", "0::/\n")) is None


def test_the_tightest_cpu_max_from_this_cgroup_up_to_the_root_wins(tmp_path):
    """A systemd slice (CPUQuota=) limits its children: the process's own cgroup may say "max"."""
    _write(tmp_path / "cpu.max", "max 100000\n")
    _write(tmp_path / "user.slice" / "cpu.max", "300000 100000\n")
    _write(tmp_path / "user.slice" / "job.scope" / "cpu.max", "max 100000\n")
    proc = _write(tmp_path / "self-cgroup", "0::/user.slice/job.scope\n")
    assert cgroup_cpu_limit(tmp_path, proc) == 3.0
    _write(tmp_path / "user.slice" / "job.scope" / "cpu.max", "120000 100000\n")
    assert cgroup_cpu_limit(tmp_path, proc) == 1.2
    # a host without a quota anywhere: no limit
    for f in tmp_path.rglob("cpu.max"):
        f.write_text("max 100000\n")
    assert cgroup_cpu_limit(tmp_path, proc) is None


@pytest.mark.parametrize("mount", ["cpu", "cpu,cpuacct"])
def test_cgroup_v1_cfs_quota(tmp_path, mount):
    proc = _write(tmp_path / "self-cgroup", f"4:memory:/x\n3:{mount}:/\n0::/\n")
    _write(tmp_path / mount / "cpu.cfs_period_us", "100000\n")
    _write(tmp_path / mount / "cpu.cfs_quota_us", "-1\n")
    assert cgroup_cpu_limit(tmp_path, proc) is None
    _write(tmp_path / mount / "cpu.cfs_quota_us", "250000\n")
    assert cgroup_cpu_limit(tmp_path, proc) == 2.5
    assert parse_cfs_quota("-1", "100000") is None and parse_cfs_quota("50000\n", "100000\n") == 0.5
    with pytest.raises(ValueError):
        parse_cfs_quota("many", "100000")


def test_v1_path_of_the_host_that_the_container_cannot_see(tmp_path):
    """/proc/self/cgroup names the host's path (/docker/<id>) while the mount is the container's own cgroup."""
    proc = _write(tmp_path / "self-cgroup", "2:cpu,cpuacct:/docker/0123abcd\n")
    _write(tmp_path / "cpu,cpuacct" / "cpu.cfs_quota_us", "100000\n")
    _write(tmp_path / "cpu,cpuacct" / "cpu.cfs_period_us", "100000\n")
    assert cgroup_cpu_limit(tmp_path, proc) == 1.0


def test_no_cgroup_files_means_no_limit(tmp_path):
    assert cgroup_cpu_limit(tmp_path / "absent", tmp_path / "absent-too") is None


def test_usable_cpus_is_the_affinity_capped_by_the_quota_rounded_up(tmp_path):
    affinity = len(os.sched_getaffinity(0))
    proc = _write(tmp_path / "self-cgroup", "0::/\n")
    assert usable_cpus(tmp_path, proc) == affinity  # no cpu.max: the affinity mask alone
    _write(tmp_path / "cpu.max", "50000 100000\n")
    assert usable_cpus(tmp_path, proc) == 1  # half a CPU still runs one thread
    _write(tmp_path / "cpu.max", "150000 100000\n")
    assert usable_cpus(tmp_path, proc) == min(affinity, 2)
    _write(tmp_path / "cpu.max", f"{(affinity + 8) * 100000} 100000\n")
    assert usable_cpus(tmp_path, proc) == affinity  # a quota above the mask does not add CPUs


def test_threads_per_rank_splits_the_usable_cpus():
    n = usable_cpus()
    assert threads_per_rank(1) == n
    assert threads_per_rank(2) == max(1, n // 2)
    assert threads_per_rank(10 * n + 1) == 1


@pytest.mark.timeout(30)
@pytest.mark.skipif(shutil.which("taskset") is None or not hasattr(os, "sched_getaffinity"),
                    reason="needs taskset (util-linux) and sched_getaffinity")
def test_a_process_pinned_to_one_cpu_gets_one_thread_per_rank():
    """A real process under `taskset -c <one cpu>`: os.cpu_count() still says every core, we say 1."""
    cpu = min(os.sched_getaffinity(0))
    # The module alone (no torch import): it is what the launcher's agent calls before anything else.
    code = ("import importlib.util, os, sys\n"
            f"spec = importlib.util.spec_from_file_location('cpu_quota', {str(MODULE)!r})\n"
            "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
            "print(os.cpu_count(), m.usable_cpus(), m.threads_per_rank(1), m.threads_per_rank(2))\n")
    out = subprocess.run(["taskset", "-c", str(cpu), sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=20, check=True).stdout.split()
    assert [int(x) for x in out[1:]] == [1, 1, 1]
    assert int(out[0]) == os.cpu_count()
