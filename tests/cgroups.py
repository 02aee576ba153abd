"""Child cgroups for tests: fail under CI=true where none can be made, else skip."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from bench.cgroups import ChildCgroup, make_child_cgroup
from tests.ci import unavailable

__all__ = ["ChildCgroup", "child_cgroup"]


@contextlib.contextmanager
def child_cgroup(
    name: str, controller: str = "memory", parent: ChildCgroup | None = None
) -> Iterator[ChildCgroup]:
    """A fresh child of this process's ``controller`` cgroup (or of ``parent``), removed
    afterwards (whatever still runs inside is killed first). Where none can be made (not
    root, no such controller, read-only): fail when CI is set (CI runs as root with writable
    memory and cpu controllers), else skip."""
    try:
        cgroup = make_child_cgroup(f"test-{name}", controller, parent)
    except OSError as exc:
        message = f"cannot make a {controller} cgroup to run the replica in: {exc}"
        unavailable(message)
    try:
        yield cgroup
    finally:
        cgroup.remove()
