"""How many CPUs this process may really use: its affinity mask, capped by its cgroup's CPU quota.

``os.cpu_count()`` counts the host's cores. In a container (Binder, Kubernetes, ``docker --cpus``) the
kernel lets the process run on all of them, but the cgroup's CPU bandwidth limit allows only
``quota / period`` CPUs' worth of time per period: give each rank ``cpu_count // nproc`` OpenMP threads
there and they spend most of each period throttled. The limit is read from

* cgroup v2: ``cpu.max``, ``"QUOTA PERIOD"`` in microseconds, or ``"max PERIOD"`` for no limit;
* cgroup v1: ``cpu.cfs_quota_us`` (``-1`` for no limit) and ``cpu.cfs_period_us``, under the ``cpu``
  controller's mount (``/sys/fs/cgroup/cpu`` or ``/sys/fs/cgroup/cpu,cpuacct``),

in this process's own cgroup (``/proc/self/cgroup``) and each of its parents (the tightest wins, as in
the kernel); in a container with its own cgroup namespace that is the mount's root.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

__all__ = ["usable_cpus", "threads_per_rank", "cgroup_cpu_limit", "parse_cpu_max", "parse_cfs_quota"]

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")
_V1_CPU_MOUNTS = ("cpu", "cpu,cpuacct", "cpuacct,cpu")


def parse_cpu_max(text: str) -> float | None:
    """CPUs allowed by a cgroup v2 ``cpu.max`` (``"150000 100000"`` -> 1.5); None for ``"max ..."`` (no limit).

    Raises ValueError on text that is not ``QUOTA [PERIOD]`` (PERIOD defaults to the kernel's 100000).
    """
    fields = text.split()
    if not 1 <= len(fields) <= 2:
        raise ValueError(f"cpu.max holds {text.strip()!r}, not 'QUOTA PERIOD'")
    if fields[0] == "max":
        return None
    quota, period = int(fields[0]), int(fields[1]) if len(fields) == 2 else 100_000
    if quota <= 0 or period <= 0:
        raise ValueError(f"cpu.max holds {text.strip()!r}: quota and period must be positive")
    return quota / period


def parse_cfs_quota(quota_text: str, period_text: str) -> float | None:
    """CPUs allowed by cgroup v1's ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``; None for quota -1 (no limit)."""
    quota, period = int(quota_text.strip()), int(period_text.strip())
    if quota < 0:
        return None
    if quota == 0 or period <= 0:
        raise ValueError(f"cpu.cfs_quota_us={quota}, cpu.cfs_period_us={period}: not a CPU limit")
    return quota / period


def _own_cgroups(proc_cgroup: Path) -> tuple[str, dict[str, str]]:
    """This process's cgroup v2 path ("0::/a/b") and its v1 paths by controller list ("cpu,cpuacct")."""
    v2, v1 = "/", {}
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return v2, v1
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and not controllers:
            v2 = path or "/"
        else:
            v1[controllers] = path or "/"
    return v2, v1


def _dirs_up(mount: Path, path: str) -> list[Path]:
    """``mount/path`` and each parent up to ``mount`` itself: where a limit on this process can be set."""
    parts = [p for p in path.split("/") if p]
    return [mount.joinpath(*parts[:i]) for i in range(len(parts), -1, -1)]


def _tightest(limits: list[float | None]) -> float | None:
    found = [x for x in limits if x is not None]
    return min(found) if found else None


def _read_v2(d: Path) -> float | None:
    try:
        return parse_cpu_max((d / "cpu.max").read_text())
    except (OSError, ValueError):
        return None


def _read_v1(d: Path) -> float | None:
    try:
        return parse_cfs_quota((d / "cpu.cfs_quota_us").read_text(), (d / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None


def cgroup_cpu_limit(root: str | Path = CGROUP_ROOT, proc_cgroup: str | Path = PROC_CGROUP) -> float | None:
    """The CPU bandwidth limit on this process in CPUs (may be fractional), or None when there is none.

    ``root`` is where cgroups are mounted and ``proc_cgroup`` the file naming this process's cgroups
    (parameters so tests can point them at files of their own). A file that is missing or unreadable is
    treated as no limit: the answer is never worse than ``os.cpu_count()``'s.
    """
    root = Path(root)
    v2_path, v1_paths = _own_cgroups(Path(proc_cgroup))
    limit = _tightest([_read_v2(d) for d in _dirs_up(root, v2_path)])
    if limit is not None:
        return limit
    for mount in _V1_CPU_MOUNTS:
        if not (root / mount).is_dir():
            continue
        path = next((p for c, p in v1_paths.items() if "cpu" in c.split(",")), "/")
        # In a container the mount's root is the container's own cgroup, while /proc/self/cgroup may
        # still name the host's path: the directories that do not exist are skipped.
        limit = _tightest([_read_v1(d) for d in _dirs_up(root / mount, path)])
        if limit is not None:
            return limit
    return None


def usable_cpus(root: str | Path = CGROUP_ROOT, proc_cgroup: str | Path = PROC_CGROUP) -> int:
    """CPUs this process may run on: its affinity mask (``taskset``, cpusets), capped by the cgroup CPU
    quota rounded up (1.5 CPUs -> 2), at least 1. What ``os.cpu_count()`` would be inside a container."""
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    limit = cgroup_cpu_limit(root, proc_cgroup)
    if limit is not None:
        n = min(n, math.ceil(limit))
    return max(1, n)


def threads_per_rank(nproc: int) -> int:
    """Intra-op (OpenMP) threads for each of ``nproc`` ranks sharing this machine: its usable CPUs split
    evenly, at least 1. The launcher's agent sets ``OMP_NUM_THREADS`` to this unless it is already set."""
    return max(1, usable_cpus() // max(1, nproc))
