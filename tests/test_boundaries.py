"""Keep the package boundaries true: models imports neither batching nor server;
batching never imports a concrete model (nor server); bulk jobs and generation compose
models and batching without the server; none of models and batching imports bulk or
generation; the server imports neither the benchmarks nor bulk jobs (``batchfit``, above every
room, composes their commands); no room imports ``batchfit``."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FORBIDDEN = {
    "models": {"server", "batching", "bulk", "generation", "batchfit"},
    "batching": {"server", "models", "bulk", "generation", "batchfit"},
    "bulk": {"server", "generation", "batchfit"},
    "generation": {"server", "bulk", "batchfit"},
    "server": {"bench", "bulk", "batchfit"},
}


def imported_packages(path: Path) -> set[str]:
    """Every top-level package the module imports, at its top or inside a function."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_boundaries(package):
    files = sorted((ROOT / package).rglob("*.py"))
    assert files
    for path in files:
        bad = imported_packages(path) & FORBIDDEN[package]
        assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


def test_the_server_imports_neither_the_benchmarks_nor_bulk_jobs():
    """``server/`` sits below ``batchfit``: the command line that offers ``batchfit bench`` and
    ``batchfit embed`` composes those rooms; the server never reaches up into them, at a
    module's top or inside a function."""
    files = sorted((ROOT / "server").rglob("*.py"))
    assert ROOT / "server" / "cli.py" in files
    bad = {
        str(path.relative_to(ROOT)): sorted(imported_packages(path) & {"bench", "bulk"})
        for path in files
    }
    assert {path: names for path, names in bad.items() if names} == {}


@pytest.mark.parametrize(
    "package", ["batchfit", "server", "batching", "models", "generation", "bulk"]
)
def test_public_names_are_exported(package):
    module = __import__(package)
    assert module.__all__
    for name in module.__all__:
        assert hasattr(module, name)


def test_serving_never_imports_pyarrow():
    """``batchfit serve`` imports the bulk commands' parsers but not Parquet: pyarrow's
    libraries would add their resident pages to every replica under a memory limit."""
    code = "import sys, batchfit.cli, server.app; print('pyarrow' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True, cwd=ROOT)  # fmt: skip
    assert done.stdout.strip() == "False"
