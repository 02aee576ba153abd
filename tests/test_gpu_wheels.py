"""The wheel list for bare GPU machines against pyproject.toml and what is installed here."""

from __future__ import annotations

import importlib.metadata
import tomllib
import zipfile
from pathlib import Path

import numpy as np
import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from safetensors.numpy import load, save

from scripts.gpu_wheels import (
    NEVER,
    PRESENT,
    WHEELS,
    download_command,
    normalize,
    pinned,
    repack_halved,
)

ROOT = Path(__file__).resolve().parent.parent
# The GPU machine: Python 3.12 on x86-64 Linux.
GPU_ENVIRONMENT = {
    **default_environment(),
    "python_version": "3.12",
    "python_full_version": "3.12.3",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "platform_python_implementation": "CPython",
    "implementation_name": "cpython",
}


def runtime_requirements() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [Requirement(spec) for spec in project["dependencies"]]


def needs(requirement: Requirement) -> list[Requirement]:
    """What an installed distribution requires on the GPU machine, with the asked extras."""
    found = []
    for spec in importlib.metadata.requires(requirement.name) or []:
        child = Requirement(spec)
        if child.marker is None:
            found.append(child)
            continue
        extras = requirement.extras or {""}
        if any(child.marker.evaluate({**GPU_ENVIRONMENT, "extra": e}) for e in extras):
            found.append(child)
    return found


def shipped_closure() -> set[str]:
    """Every distribution the GPU machine needs and lacks: our runtime dependencies and
    theirs, walked through installed metadata down to the packages already there."""
    missing: list[str] = []
    shipped: set[str] = set()
    todo = runtime_requirements()
    while todo:
        requirement = todo.pop()
        name = normalize(requirement.name)
        if name in PRESENT or name in shipped:
            continue
        if name not in {normalize(w) for w in WHEELS}:
            missing.append(f"{requirement} (needed, neither shipped nor on the machine)")
            continue
        shipped.add(name)
        todo.extend(needs(requirement))
    assert not missing, missing
    return shipped


def test_every_runtime_dependency_is_shipped_or_on_the_machine():
    names = {normalize(r.name) for r in runtime_requirements()}
    assert names <= PRESENT | {normalize(w) for w in WHEELS}, names - PRESENT


def test_the_wheel_list_is_exactly_what_the_machine_lacks():
    # Nothing missing (checked inside), nothing extra that no dependency needs.
    assert shipped_closure() == {normalize(w) for w in WHEELS}


def test_torch_and_the_machines_own_packages_never_travel():
    assert "torch" in NEVER and "torch" in PRESENT
    shipped = {normalize(w) for w in WHEELS}
    assert not shipped & PRESENT, "a shipped copy would shadow the machine's own"
    assert not shipped & NEVER
    with pytest.raises(ValueError, match="never be shipped"):
        pinned(("torch",))


def test_download_is_cp312_manylinux_binaries_pinned_to_what_was_tested():
    pins = pinned()
    assert len(pins) == len(WHEELS)
    assert f"fastapi=={importlib.metadata.version('fastapi')}" in pins
    command = download_command(Path(".whl"), pins)
    joined = " ".join(command)
    for part in ("--no-deps", "--only-binary=:all:", "--python-version 3.12",
                 "--implementation cp", "--platform manylinux2014_x86_64"):  # fmt: skip
        assert part in joined
    assert not any(arg.startswith("torch") for arg in command)


def test_the_model_wheel_is_repacked_with_float16_weights(tmp_path):
    weights = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "ids": np.arange(3)}
    wheel = tmp_path / "demo_model-0.1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as out:
        out.writestr("demo_model/model/model.safetensors", save(weights))
        out.writestr("demo_model/__init__.py", "")
        out.writestr("demo_model-0.1.0.dist-info/METADATA", "Name: demo-model\nVersion: 0.1.0\n")
        out.writestr("demo_model-0.1.0.dist-info/RECORD", "stale")
    repacked = repack_halved(wheel)
    assert repacked.name == "demo_model-0.1.0+fp16-py3-none-any.whl"
    assert not wheel.exists()
    with zipfile.ZipFile(repacked) as archive:
        names = archive.namelist()
        tensors = load(archive.read("demo_model/model/model.safetensors"))
        metadata = archive.read("demo_model-0.1.0+fp16.dist-info/METADATA").decode()
        record = archive.read("demo_model-0.1.0+fp16.dist-info/RECORD").decode()
    assert tensors["w"].dtype == np.float16 and tensors["ids"].dtype == np.int64
    np.testing.assert_array_equal(tensors["w"], weights["w"])
    assert "Version: 0.1.0+fp16" in metadata
    assert not any("0.1.0.dist-info" in n for n in names)
    assert "demo_model/model/model.safetensors,sha256=" in record
