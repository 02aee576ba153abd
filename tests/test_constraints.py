"""constraints.txt: the versions every install path of the checkout takes, complete and within
pyproject.toml's ranges."""

from __future__ import annotations

import importlib.metadata
import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
EXTRAS = sorted(PROJECT["optional-dependencies"])


def pins() -> dict[str, str]:
    pinned = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, version = line.split("==")
            assert canonicalize_name(name) not in pinned, f"{name} is pinned twice"
            pinned[canonicalize_name(name)] = version
    return pinned


def requirements() -> list[Requirement]:
    listed = [
        *PROJECT["dependencies"],
        *(r for e in EXTRAS for r in PROJECT["optional-dependencies"][e]),
    ]
    return [Requirement(r) for r in listed]


def test_every_requirement_is_pinned_within_its_range():
    pinned = pins()
    for requirement in requirements():
        name = canonicalize_name(requirement.name)
        assert name in pinned, f"{requirement} has no pin in constraints.txt (make lock)"
        assert requirement.specifier.contains(pinned[name], prereleases=True), (
            f"constraints.txt pins {name}=={pinned[name]}, outside pyproject.toml's {requirement}"
        )


def test_everything_the_requirements_pull_in_is_pinned():
    """The closure of the requirements over what is installed here (extras and markers
    followed as pip follows them): a dependency left unpinned moves with every release."""
    pinned = pins()
    seen: set[str] = set()
    todo = [(requirement, "") for requirement in requirements()]
    while todo:
        requirement, extra = todo.pop()
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": extra}):
            continue
        name = canonicalize_name(requirement.name)
        wanted = [(name, e) for e in ("", *sorted(requirement.extras))]
        new = [key for key in wanted if f"{key[0]}[{key[1]}]" not in seen]
        if not new:
            continue
        seen.update(f"{n}[{e}]" for n, e in new)
        assert name in pinned, (
            f"{name} (for {requirement}) has no pin in constraints.txt (make lock)"
        )
        distribution = importlib.metadata.distribution(name)
        for dependency in distribution.requires or []:
            todo.extend((Requirement(dependency), e) for _, e in new)
    assert len({key.split("[")[0] for key in seen}) > 50  # the walk went past the first level


def test_installs_and_the_image_take_the_pins():
    makefile = (ROOT / "Makefile").read_text()
    (install,) = re.findall(r"pip install .*-e '\.\[.*", makefile)
    assert "--constraint constraints.txt" in install
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "COPY pyproject.toml README.md constraints.txt" in dockerfile
    assert re.search(r"^RUN pip install --constraint constraints.txt \. ", dockerfile, re.MULTILINE)
    # torch is installed on its own first, at the project's exact pin.
    (torch,) = [r for r in requirements() if r.name == "torch"]
    assert str(torch.specifier) == f"=={pins()['torch']}"
    assert f"torch=={pins()['torch']}" in makefile and f"torch=={pins()['torch']}" in dockerfile
