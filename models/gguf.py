"""GGUF files, dequantized once by transformers' own GGUF loading and kept as a safetensors
folder, so that every later start loads in seconds instead of a minute.

Reading a GGUF through transformers parses its whole vocabulary in Python and dequantizes
every tensor: about 65 s for Gemma-3-270m on 2 CPUs (the config, the tokenizer and the
weights each read the file), against 3 s for the folder written here.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path

from .errors import ModelLoadError

log = logging.getLogger(__name__)

CACHE_ENV = "BATCHFIT_CACHE_DIR"
FOLDER_VERSION = "1"
"""Part of every converted folder's name: a new way of converting never reads an old one."""


def is_gguf(source: str) -> bool:
    """A ``.gguf`` file, or a folder holding exactly one and no ``config.json``."""
    path = Path(source).expanduser()
    if path.suffix == ".gguf":
        return True
    return path.is_dir() and not (path / "config.json").exists() and len(_gguf_files(path)) == 1


def _gguf_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.gguf"))


def gguf_file(source: str) -> Path:
    """The GGUF file ``source`` names (the file, or the one in a folder)."""
    path = Path(source).expanduser()
    if path.is_dir():
        found = _gguf_files(path)
        if len(found) != 1:
            raise ModelLoadError(f"{source!r} holds {len(found)} .gguf files; name one")
        path = found[0]
    if not path.is_file():
        raise ModelLoadError(f"no such GGUF file: {source!r} ({path.resolve()} does not exist)")
    return path.resolve()


def cache_root() -> Path:
    """Where converted folders live: ``$BATCHFIT_CACHE_DIR/gguf``, else
    ``~/.cache/batchfit/gguf``."""
    base = os.environ.get(CACHE_ENV)
    root = Path(base).expanduser() if base else Path.home() / ".cache" / "batchfit"
    return root / "gguf"


def converted_folder(source: str, *, root: Path | None = None) -> Path:
    """The safetensors folder of the GGUF file ``source``, converting it on first use. The
    folder is keyed by the file's path, size and modification time, so a file replaced in
    place is converted again; it is written beside its final name and renamed into place, so
    a conversion cut short leaves nothing a later start would read."""
    path = gguf_file(source)
    stat = path.stat()
    key = hashlib.sha256(
        f"{FOLDER_VERSION}\0{path}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()
    ).hexdigest()[:16]
    root = root if root is not None else cache_root()
    folder = root / f"{path.stem}-{key}"
    if (folder / "config.json").is_file():
        return folder
    root.mkdir(parents=True, exist_ok=True)
    log.info("converting %s to safetensors once (in %s); later starts read that", path, folder)
    scratch = Path(tempfile.mkdtemp(prefix=f".{path.stem}-", dir=root))
    try:
        _convert(path, scratch)
        try:
            scratch.rename(folder)
        except OSError:
            if not (folder / "config.json").is_file():  # not another process's, finished first
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return folder


def _convert(path: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        module = AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32
        )
    except (OSError, ValueError, KeyError, ImportError) as exc:
        raise ModelLoadError(f"cannot read GGUF file {str(path)!r}: {exc}") from exc
    # The weights are dequantized: what is saved is a plain float32 checkpoint.
    module.hf_quantizer = None
    if hasattr(module.config, "quantization_config"):
        del module.config.quantization_config
    module.save_pretrained(out)
    tokenizer.save_pretrained(out)
