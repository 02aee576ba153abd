"""Finding and reading this process's memory and cpu cgroups: pure parsing, table-driven."""

from __future__ import annotations

from pathlib import Path

import pytest

from batching import HostProbe
from batching.procfs import (
    Cgroup,
    CgroupLimit,
    CgroupMemory,
    CpuQuota,
    MemoryCgroup,
    OpenFiles,
    cpu_quota,
    find_cgroup,
    find_memory_cgroup,
    parse_cfs_quota,
    parse_cpu_max,
    parse_limit,
    parse_proc_cgroup,
    stat_field,
    tightest,
    v1_level,
    v2_level,
    working_set,
)

MiB = 2**20
V1_UNLIMITED = "9223372036854771712"

# This machine kind: v1 controllers plus an empty unified hierarchy (hybrid).
HYBRID_CGROUP = """\
9:name=systemd:/
4:memory:/process_api/abc
1:cpu:/
0::/
"""
HYBRID_MOUNTINFO = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,name=systemd
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""
V2_MOUNTINFO = (
    "30 23 0:26 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 cgroup2 "
    "rw,nsdelegate,memory_recursiveprot\n"
)
# A v1 container without a cgroup namespace: only its own subtree is mounted.
DOCKER_V1_MOUNTINFO = (
    "700 690 0:32 /docker/ctr /sys/fs/cgroup/memory ro,nosuid - cgroup cgroup rw,memory\n"
)
# A subtree mounted somewhere else, with an escaped space in the mount point.
KUBE_MOUNTINFO = "88 31 0:32 /kubepods /mnt/my\\040cgroups rw - cgroup cgroup rw,memory,cpu\n"

V2_CONTROLLERS = {
    "/sys/fs/cgroup/system.slice/x.service/cgroup.controllers": "cpu io memory pids",
    "/sys/fs/cgroup/cgroup.controllers": "cpuset cpu io memory pids",
    "/sys/fs/cgroup/unified/cgroup.controllers": "",
}


def read_from(files):
    def read(path):
        if path not in files:
            raise FileNotFoundError(path)
        return files[path]

    return read


@pytest.mark.parametrize(
    ("proc_cgroup", "mountinfo", "expected"),
    [
        pytest.param(
            HYBRID_CGROUP, HYBRID_MOUNTINFO,
            MemoryCgroup(1, (
                ("/process_api/abc", "/sys/fs/cgroup/memory/process_api/abc"),
                ("/process_api", "/sys/fs/cgroup/memory/process_api"),
                ("/", "/sys/fs/cgroup/memory"),
            )),
            id="hybrid: memory on v1, the empty unified hierarchy ignored",
        ),
        pytest.param(
            "4:memory:/user.slice\n", HYBRID_MOUNTINFO,
            MemoryCgroup(1, (
                ("/user.slice", "/sys/fs/cgroup/memory/user.slice"),
                ("/", "/sys/fs/cgroup/memory"),
            )),
            id="v1 only",
        ),
        pytest.param(
            "0::/system.slice/x.service\n", V2_MOUNTINFO,
            MemoryCgroup(2, (
                ("/system.slice/x.service", "/sys/fs/cgroup/system.slice/x.service"),
                ("/system.slice", "/sys/fs/cgroup/system.slice"),
                ("/", "/sys/fs/cgroup"),
            )),
            id="v2, nested",
        ),
        pytest.param(
            "0::/\n", V2_MOUNTINFO, MemoryCgroup(2, (("/", "/sys/fs/cgroup"),)),
            id="v2 in a cgroup namespace: the path is /",
        ),
        pytest.param(
            "12:memory:/docker/ctr\n", DOCKER_V1_MOUNTINFO,
            MemoryCgroup(1, (("/docker/ctr", "/sys/fs/cgroup/memory"),)),
            id="v1 mount whose root is the process's own cgroup",
        ),
        pytest.param(
            "5:cpu,memory:/kubepods/pod1/ctr\n", KUBE_MOUNTINFO,
            MemoryCgroup(1, (
                ("/kubepods/pod1/ctr", "/mnt/my cgroups/pod1/ctr"),
                ("/kubepods/pod1", "/mnt/my cgroups/pod1"),
                ("/kubepods", "/mnt/my cgroups"),
            )),
            id="mount root below the hierarchy root, co-mounted controllers, escaped path",
        ),
        pytest.param(
            "5:memory:/elsewhere/x\n", KUBE_MOUNTINFO, None,
            id="the only mount does not hold the process's cgroup",
        ),
        pytest.param("9:name=systemd:/\n0::/\n", HYBRID_MOUNTINFO, None,
                     id="hybrid without a memory controller anywhere"),
        pytest.param("", V2_MOUNTINFO, None, id="no /proc/self/cgroup lines"),
    ],
)  # fmt: skip
def test_find_memory_cgroup(proc_cgroup, mountinfo, expected):
    assert find_memory_cgroup(proc_cgroup, mountinfo, read_from(V2_CONTROLLERS)) == expected


def test_proc_cgroup_keys_v1_controllers_and_the_unified_entry():
    assert parse_proc_cgroup("4:memory,cpu:/a\n0::/b\n9:name=systemd:/c:d\nodd\n") == {
        "memory": "/a",
        "cpu": "/a",
        "": "/b",
        "name=systemd": "/c:d",
    }


@pytest.mark.parametrize(
    ("text", "value"),
    [
        (b"max\n", None),
        (V1_UNLIMITED.encode() + b"\n", None),
        (b"524288000\n", 524288000),
        (b"0\n", 0),
        (b"", None),
    ],
)
def test_parse_limit(text, value):
    assert parse_limit(text) == value


def test_stat_field_matches_whole_names():
    stat = b"cache 10\ninactive_file 7\ntotal_inactive_file 30\nhierarchical_memory_limit 99"
    assert stat_field(stat, b"inactive_file") == 7
    assert stat_field(stat, b"total_inactive_file") == 30
    assert stat_field(stat, b"hierarchical_memory_limit") == 99  # last line, no newline
    assert stat_field(stat, b"file") is None


@pytest.mark.parametrize(
    ("usage", "inactive", "expected"), [(300, 50, 250), (300, 0, 300), (40, 50, 0)]
)
def test_working_set_is_usage_less_inactive_file(usage, inactive, expected):
    assert working_set(usage, inactive) == expected


def v1_stat(limit, inactive, own_inactive=0):
    return (
        f"cache 1\ninactive_file {own_inactive}\nhierarchical_memory_limit {limit}\n"
        f"total_cache 2\ntotal_inactive_file {inactive}\n"
    ).encode()


@pytest.mark.parametrize(
    ("stat", "usage", "expected"),
    [
        (v1_stat(V1_UNLIMITED, 0), b"100\n", None),
        # total_inactive_file (the whole subtree), not the cgroup's own inactive_file
        (v1_stat(500 * MiB, 50 * MiB, own_inactive=5 * MiB), b"%d\n" % (300 * MiB),
         CgroupLimit(500 * MiB, 250 * MiB, "/a")),
        (v1_stat(500 * MiB, 0), b"%d\n" % (500 * MiB), CgroupLimit(500 * MiB, 500 * MiB, "/a")),
    ],
)  # fmt: skip
def test_v1_level(stat, usage, expected):
    assert v1_level(stat, lambda: usage, "/a") == expected


def never():
    raise AssertionError("usage read without a limit")


@pytest.mark.parametrize(
    ("memory_max", "memory_high", "expected"),
    [
        (b"max\n", b"max\n", None),
        (b"1000\n", b"max\n", CgroupLimit(1000, 500, "/a")),
        (b"1000\n", b"800\n", CgroupLimit(800, 500, "/a")),  # throttled hard above high
        (b"max\n", b"900\n", CgroupLimit(900, 500, "/a")),
    ],
)
def test_v2_level_takes_the_lower_of_max_and_high(memory_max, memory_high, expected):
    stat = b"anon 400\nfile 200\nactive_file 100\ninactive_file 100\n"
    current = (lambda: b"600\n") if expected else never
    assert v2_level(memory_max, memory_high, current, lambda: stat, "/a") == expected


@pytest.mark.parametrize(
    ("limits", "expected"),
    [
        ([], None),
        ([None, None], None),
        ([CgroupLimit(1000, 100, "/a/b"), CgroupLimit(800, 300, "/a")], "/a"),
        ([CgroupLimit(1000, 600, "/a/b"), CgroupLimit(2000, 700, "/a")], "/a/b"),
        # a parent's larger limit binds first when siblings use most of it
        ([CgroupLimit(500, 100, "/a/b"), None, CgroupLimit(900, 850, "/")], "/"),
    ],
)
def test_tightest_is_the_least_room(limits, expected):
    found = tightest(limits)
    assert (found.path if found else None) == expected


def make_tree(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def levels(root: Path, *paths: str) -> tuple[tuple[str, str], ...]:
    return tuple((path, str(root) + path.rstrip("/")) for path in paths)


def test_v2_tree_reads_every_level_and_skips_the_root(tmp_path):
    make_tree(tmp_path, {
        # the root cgroup has no memory.max: left out, never read
        "memory.current": "1", "memory.stat": "inactive_file 0\n",
        "a/memory.max": "1000\n", "a/memory.high": "max\n", "a/memory.current": "700\n",
        "a/memory.stat": "inactive_file 100\n",
        "a/b/memory.max": "max\n", "a/b/memory.high": "2000\n", "a/b/memory.current": "500\n",
        "a/b/memory.stat": "inactive_file 0\n",
    })  # fmt: skip
    memory = CgroupMemory(MemoryCgroup(2, levels(tmp_path, "/a/b", "/a", "/")), OpenFiles())
    assert memory.read() == CgroupLimit(1000, 600, "/a")
    (tmp_path / "a/memory.max").write_text("max\n")  # limits change at run time
    assert memory.read() == CgroupLimit(2000, 500, "/a/b")


def test_v1_tree_stops_at_the_first_unlimited_level(tmp_path):
    make_tree(tmp_path, {
        "memory.stat": v1_stat(V1_UNLIMITED, 0).decode(), "memory.usage_in_bytes": "5000\n",
        "a/memory.stat": v1_stat(1000, 100).decode(), "a/memory.usage_in_bytes": "900\n",
        "a/b/memory.stat": v1_stat(1000, 0).decode(), "a/b/memory.usage_in_bytes": "300\n",
        "above/memory.stat": v1_stat(10, 0).decode(), "above/memory.usage_in_bytes": "0\n",
    })  # fmt: skip
    # v1's hierarchical_memory_limit already folds in every ancestor, so an unlimited level
    # has none above it: a level listed past it (here with the least room of all) is never
    # read.
    memory = CgroupMemory(MemoryCgroup(1, levels(tmp_path, "/a/b", "/a", "/")), OpenFiles())
    above = tmp_path / "above"
    memory._levels += (("/above", (str(above / "memory.stat"),
                                   str(above / "memory.usage_in_bytes"))),)  # fmt: skip
    assert len(memory._levels) == 4
    assert memory.read() == CgroupLimit(1000, 800, "/a")


def test_host_probe_says_the_cgroup_binds(tmp_path):
    make_tree(tmp_path, {
        "x/memory.max": f"{64 * MiB}\n", "x/memory.high": "max\n",
        "x/memory.current": f"{48 * MiB}\n", "x/memory.stat": f"inactive_file {8 * MiB}\n",
    })  # fmt: skip
    cgroup = MemoryCgroup(2, levels(tmp_path, "/x"))
    reading = HostProbe(cgroup=cgroup).read()
    assert reading.free_bytes == 24 * MiB
    assert reading.limit.describe() == "64 MiB (cgroup /x)"
    # A tighter --memory-limit binds instead.
    rss = reading.resident_bytes
    reading = HostProbe(cgroup=cgroup, memory_limit_bytes=rss + 4 * MiB).read()
    assert (reading.limit.source, reading.limit.where) == ("flag", "--memory-limit")
    assert reading.free_bytes <= 5 * MiB
    # No cgroup: the host's memory.
    assert HostProbe(cgroup=None).read().limit.source == "host"


def test_the_enforced_limit_is_the_cgroup_even_where_the_flag_binds(tmp_path):
    """--memory-limit caps the budget, but nothing enforces it at its value: refusals look
    at the cgroup's room under it."""
    make_tree(tmp_path, {
        "x/memory.max": f"{64 * MiB}\n", "x/memory.high": "max\n",
        "x/memory.current": f"{48 * MiB}\n", "x/memory.stat": f"inactive_file {8 * MiB}\n",
    })  # fmt: skip
    cgroup = MemoryCgroup(2, levels(tmp_path, "/x"))
    rss = HostProbe(cgroup=cgroup).read().resident_bytes
    reading = HostProbe(cgroup=cgroup, memory_limit_bytes=rss + 4 * MiB).read()
    assert reading.limit.source == "flag"
    assert reading.enforced.describe() == "64 MiB (cgroup /x)"
    assert reading.enforced_free_bytes == 24 * MiB
    assert HostProbe(cgroup=None).read().enforced.source == "host"


# --- the cpu cgroup and its quota ---


@pytest.mark.parametrize(
    ("proc_cgroup", "mountinfo", "expected"),
    [
        pytest.param(
            "4:memory:/process_api/abc\n1:cpu:/a/b\n0::/\n", HYBRID_MOUNTINFO,
            Cgroup(1, (("/a/b", "/sys/fs/cgroup/cpu/a/b"), ("/a", "/sys/fs/cgroup/cpu/a"),
                       ("/", "/sys/fs/cgroup/cpu"))),
            id="v1: its own hierarchy, not memory's",
        ),
        pytest.param(
            "5:cpu,memory:/kubepods/pod1\n", KUBE_MOUNTINFO,
            Cgroup(1, (("/kubepods/pod1", "/mnt/my cgroups/pod1"),
                       ("/kubepods", "/mnt/my cgroups"))),
            id="v1, co-mounted with memory",
        ),
        pytest.param(
            "0::/system.slice/x.service\n", V2_MOUNTINFO,
            Cgroup(2, (("/system.slice/x.service", "/sys/fs/cgroup/system.slice/x.service"),
                       ("/system.slice", "/sys/fs/cgroup/system.slice"), ("/", "/sys/fs/cgroup"))),
            id="v2, nested",
        ),
        pytest.param("0::/\n", HYBRID_MOUNTINFO, None,
                     id="hybrid whose unified hierarchy has no controllers"),
        pytest.param("3:cpuset:/\n",
                     "34 31 0:31 / /sys/fs/cgroup/cpuset rw - cgroup cgroup rw,cpuset\n", None,
                     id="cpuset is not cpu"),
    ],
)  # fmt: skip
def test_find_cpu_cgroup(proc_cgroup, mountinfo, expected):
    assert find_cgroup("cpu", proc_cgroup, mountinfo, read_from(V2_CONTROLLERS)) == expected


@pytest.mark.parametrize(
    ("text", "cpus"),
    [("max 100000\n", None), ("max\n", None), ("150000 100000\n", 1.5), ("50000 100000", 0.5),
     ("400000 200000\n", 2.0), ("", None)],
)  # fmt: skip
def test_parse_cpu_max(text, cpus):
    assert parse_cpu_max(text) == cpus


@pytest.mark.parametrize(
    ("quota", "period", "cpus"),
    [("-1\n", "100000\n", None), ("100000\n", "100000\n", 1.0), ("250000", "100000", 2.5),
     ("50000", "100000", 0.5)],
)  # fmt: skip
def test_parse_cfs_quota(quota, period, cpus):
    assert parse_cfs_quota(quota, period) == cpus


def test_v1_cpu_quota_is_the_smallest_over_every_level(tmp_path):
    # Unlike memory, v1 folds no ancestor's quota into a level's files: the walk goes on past
    # levels without one. The root has no quota; /a's binds, though /a/b/c and /a/b have none.
    make_tree(tmp_path, {
        "cpu.cfs_quota_us": "-1\n", "cpu.cfs_period_us": "100000\n",
        "a/cpu.cfs_quota_us": "150000\n", "a/cpu.cfs_period_us": "100000\n",
        "a/b/cpu.cfs_quota_us": "-1\n", "a/b/cpu.cfs_period_us": "100000\n",
        "a/b/c/cpu.cfs_quota_us": "-1\n", "a/b/c/cpu.cfs_period_us": "100000\n",
    })  # fmt: skip
    cgroup = Cgroup(1, levels(tmp_path, "/a/b/c", "/a/b", "/a", "/"))
    assert cpu_quota(cgroup) == CpuQuota(1.5, "/a")
    (tmp_path / "a/b/cpu.cfs_quota_us").write_text("300000\n")  # looser than /a's: /a binds
    assert cpu_quota(cgroup) == CpuQuota(1.5, "/a")
    (tmp_path / "a/b/c/cpu.cfs_quota_us").write_text("50000\n")
    assert cpu_quota(cgroup) == CpuQuota(0.5, "/a/b/c")


def test_v2_cpu_quota_skips_the_root_and_levels_without_one(tmp_path):
    make_tree(tmp_path, {
        "a/cpu.max": "400000 100000\n", "a/b/cpu.max": "max 100000\n",
        "a/b/c/cpu.max": "max 100000\n",
    })  # fmt: skip
    cgroup = Cgroup(2, levels(tmp_path, "/a/b/c", "/a/b", "/a", "/"))  # the root has no cpu.max
    assert cpu_quota(cgroup) == CpuQuota(4.0, "/a")
    (tmp_path / "a/cpu.max").write_text("max 100000\n")
    assert cpu_quota(cgroup) is None
