"""How many threads llama.cpp computes with when ``--threads`` is not given:
one per physical core this process may run on, no more than its CPU quota.

``os.cpu_count()`` counts every logical CPU of the machine. That is too
many three ways, each common where lmspd runs: a second hardware thread of
a core adds no arithmetic to a memory-bound decode but does add a member to
every barrier; a container sees the host's CPUs but may run on a few
(``--cpuset-cpus``: the affinity mask) or for a share of their time
(``--cpus``: the cgroup quota); and a hybrid CPU's efficiency cores are
the last to arrive at every barrier. llama.cpp's workers meet at a
spinning barrier after every operation, so a thread without a CPU of its
own stalls all the others: on two cores with one of them taken, two
threads decoded the bundled model at 0.42× the speed of one
(``bench/threads.py``). llama.cpp's
own default counts physical cores (``cpu_get_num_math``); this adds the
affinity mask and the quota.

Linux reads sysfs and procfs (``root`` makes that testable); macOS asks
``sysctl`` for its performance cores; elsewhere every logical CPU counts.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class CpuThreads:
    threads: int
    reason: str  # for the start-up log line


def default_threads(root: Path = Path("/"), affinity: set[int] | None = None,
                    platform: str = sys.platform) -> CpuThreads:
    if platform == "darwin":
        cores = _sysctl_int("hw.perflevel0.physicalcpu") or _sysctl_int("hw.physicalcpu")
        logical = os.cpu_count() or 1
        if cores:
            return CpuThreads(cores, f"{cores} performance cores of {logical} CPUs")
        return CpuThreads(logical, f"{logical} CPUs")
    if affinity is None:
        affinity = set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else set(
            range(os.cpu_count() or 1))
    if platform != "linux" or not affinity:
        n = max(1, len(affinity))
        return CpuThreads(n, f"{n} CPUs")
    usable = _performance_cpus(root, affinity)
    cores = _physical_cores(root, usable)
    why = [f"{cores} physical cores of the {len(affinity)} CPUs this process may use"]
    if usable != affinity:
        why.append(f"{len(affinity) - len(usable)} efficiency CPUs left out")
    threads = cores
    quota = _cgroup_quota(root)
    if quota is not None and quota < threads:
        threads = max(1, math.floor(quota))
        why.append(f"CPU quota {quota:g} CPUs (cgroup cpu.max)")
    return CpuThreads(threads, ", ".join(why))


def _physical_cores(root: Path, cpus: set[int]) -> int:
    """The cores ``cpus`` lie on: CPUs that share a core list one core."""
    cores = set()
    for cpu in cpus:
        topology = root / f"sys/devices/system/cpu/cpu{cpu}/topology"
        siblings = _read(topology / "core_cpus_list") or _read(topology / "thread_siblings_list")
        cores.add(siblings or f"cpu{cpu}")  # unknown topology: a CPU is a core
    return max(1, len(cores))


def _performance_cpus(root: Path, cpus: set[int]) -> set[int]:
    """On a hybrid Intel CPU, the performance cores' CPUs among ``cpus``
    (all of them when it is not hybrid, or none of them is a P-core)."""
    listed = _read(root / "sys/devices/cpu_core/cpus")
    if not listed or _read(root / "sys/devices/cpu_atom/cpus") is None:
        return cpus
    performance = _cpu_list(listed) & cpus
    return performance or cpus


def _cgroup_quota(root: Path) -> float | None:
    """The CPU time this process's cgroup (or any cgroup above it) may use,
    in CPUs: cgroup v2's ``cpu.max``, else v1's ``cpu.cfs_quota_us``."""
    quotas = []
    for line in (_read(root / "proc/self/cgroup") or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":  # v2
            base, names = root / "sys/fs/cgroup", ["cpu.max"]
        elif "cpu" in controllers.split(","):
            base = next((root / "sys/fs/cgroup" / d for d in ("cpu,cpuacct", "cpu", "cpuacct,cpu")
                         if (root / "sys/fs/cgroup" / d).is_dir()), root / "sys/fs/cgroup/cpu")
            names = ["cpu.cfs_quota_us", "cpu.cfs_period_us"]
        else:
            continue
        here = Path(path.strip().lstrip("/"))
        # A container's own cgroup is its namespace's root: walk up to it.
        for level in [here, *here.parents]:
            quota = _quota_in(base / level, names)
            if quota is not None:
                quotas.append(quota)
    return min(quotas) if quotas else None


def _quota_in(directory: Path, names: list[str]) -> float | None:
    if names == ["cpu.max"]:
        fields = (_read(directory / "cpu.max") or "").split()
        if len(fields) == 2 and fields[0] != "max":
            return _ratio(fields[0], fields[1])
        return None
    quota, period = (_read(directory / name) for name in names)
    if quota is None or period is None or quota.strip() == "-1":
        return None
    return _ratio(quota, period)


def _ratio(quota: str, period: str) -> float | None:
    try:
        q, p = int(quota), int(period)
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None


def _cpu_list(text: str) -> set[int]:
    """A kernel CPU list ("0-3,8,10-11")."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        try:
            cpus.update(range(int(lo), int(hi or lo) + 1))
        except ValueError:
            continue
    return cpus


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None


def _sysctl_int(name: str) -> int | None:
    try:
        out = subprocess.run(["sysctl", "-n", name], capture_output=True, text=True, timeout=5, check=False)
        return int(out.stdout.strip()) if out.returncode == 0 else None
    except (OSError, ValueError, subprocess.SubprocessError):
        return None
