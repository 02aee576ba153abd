"""A child memory cgroup for tests: fails under CI=true where none can be made, else skips."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from bench.cgroups import ChildCgroup, make_child_cgroup
from tests.ci import unavailable

__all__ = ["ChildCgroup", "child_cgroup"]


@contextlib.contextmanager
def child_cgroup(name: str) -> Iterator[ChildCgroup]:
    """A fresh child of this process's memory cgroup, removed afterwards (whatever still runs
    inside is killed first). Where none can be made (not root, no memory controller,
    read-only): fail when CI is set (CI runs as root with a writable controller), else skip."""
    try:
        cgroup = make_child_cgroup(f"test-{name}")
    except OSError as exc:
        message = f"cannot make a memory cgroup to run the replica in: {exc}"
        unavailable(message)
    try:
        yield cgroup
    finally:
        cgroup.remove()
