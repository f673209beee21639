"""The default thread count (no ``--threads``): one per physical core the
process may run on, no more than its cgroup CPU quota, performance cores
only on a hybrid CPU — read from a fake sysfs/procfs tree per machine
shape. ``os.cpu_count()`` would give 16, 64 and 8 for the first three."""

from __future__ import annotations

from pathlib import Path

from lmspd.engines.llama.cpus import default_threads


def machine(root: Path, cores: int, smt: int = 1, *, cgroup: str = "0::/\n", files: dict[str, str] | None = None) -> None:
    """``cores`` cores of ``smt`` hardware threads each, numbered as Linux
    numbers them (the second thread of core 0 is CPU ``cores``)."""
    for core in range(cores):
        siblings = ",".join(str(core + k * cores) for k in range(smt))
        for k in range(smt):
            topology = root / f"sys/devices/system/cpu/cpu{core + k * cores}/topology"
            topology.mkdir(parents=True)
            (topology / "thread_siblings_list").write_text(siblings + "\n")
    (root / "proc/self").mkdir(parents=True)
    (root / "proc/self/cgroup").write_text(cgroup)
    for name, text in (files or {}).items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def test_a_hyperthreaded_desktop_gets_one_thread_per_core(tmp_path):
    machine(tmp_path, cores=8, smt=2)
    chosen = default_threads(tmp_path, affinity=set(range(16)), platform="linux")
    assert chosen.threads == 8
    assert "8 physical cores of the 16 CPUs" in chosen.reason


def test_a_container_limited_by_a_quota_gets_the_quota(tmp_path):
    # docker run --cpus 4 on a 32-core host: the container's cgroup is its namespace root.
    machine(tmp_path, cores=32, smt=2, files={"sys/fs/cgroup/cpu.max": "400000 100000\n"})
    chosen = default_threads(tmp_path, affinity=set(range(64)), platform="linux")
    assert chosen.threads == 4
    assert "quota 4 CPUs" in chosen.reason


def test_a_quota_set_on_a_parent_cgroup_holds_for_its_children(tmp_path):
    machine(tmp_path, cores=8, cgroup="0::/user.slice/app.service\n",
            files={"sys/fs/cgroup/user.slice/cpu.max": "150000 100000\n",
                   "sys/fs/cgroup/user.slice/app.service/cpu.max": "max 100000\n"})
    assert default_threads(tmp_path, affinity=set(range(8)), platform="linux").threads == 1


def test_cgroup_v1_quota(tmp_path):
    machine(tmp_path, cores=8, cgroup="5:cpu,cpuacct:/docker/abc\n",
            files={"sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "200000\n",
                   "sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000\n"})
    assert default_threads(tmp_path, affinity=set(range(8)), platform="linux").threads == 2


def test_an_affinity_mask_counts_only_the_cores_it_allows(tmp_path):
    # taskset -c 0,8,1 on 8 cores x 2 threads: CPUs 0 and 8 are one core.
    machine(tmp_path, cores=8, smt=2)
    assert default_threads(tmp_path, affinity={0, 8, 1}, platform="linux").threads == 2


def test_a_hybrid_cpu_counts_its_performance_cores(tmp_path):
    # 6 P-cores with 2 threads (CPUs 0-11) and 8 E-cores (12-19).
    machine(tmp_path, cores=6, smt=2, files={"sys/devices/cpu_core/cpus": "0-11\n",
                                             "sys/devices/cpu_atom/cpus": "12-19\n"})
    for cpu in range(12, 20):
        topology = tmp_path / f"sys/devices/system/cpu/cpu{cpu}/topology"
        topology.mkdir(parents=True)
        (topology / "thread_siblings_list").write_text(f"{cpu}\n")
    chosen = default_threads(tmp_path, affinity=set(range(20)), platform="linux")
    assert chosen.threads == 6
    assert "8 efficiency CPUs left out" in chosen.reason


def test_an_unlimited_quota_and_an_unknown_topology_count_every_cpu(tmp_path):
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/self/cgroup").write_text("0::/\n")
    (tmp_path / "sys/fs/cgroup").mkdir(parents=True)
    (tmp_path / "sys/fs/cgroup/cpu.max").write_text("max 100000\n")
    assert default_threads(tmp_path, affinity=set(range(6)), platform="linux").threads == 6


def test_this_machine_gets_at_least_one_thread_and_says_why():
    chosen = default_threads()
    assert chosen.threads >= 1 and chosen.reason
