"""``batchfit embed | classify | rerank INPUT... --out DIR``: the command line of bulk jobs.

``batchfit/cli.py`` composes these subcommands into ``batchfit``; everything they do is here.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

from pydantic import ByteSize, TypeAdapter, ValidationError

from models import BUNDLED_MODEL, ModelError

from .job import JobError, JobSpec, run_job
from .manifest import ManifestMismatch
from .pipeline import PartWriteError, StrictReject
from .progress import BarAwareHandler, Progress
from .readers import FORMATS, ReaderError

COMMANDS = {
    "embed": "Embed every input row; Parquet parts with an id and an embedding column.",
    "classify": "Classify every input row; Parquet parts with id, label and score columns.",
    "rerank": "Score every (query, document) row with a cross-encoder; id and score columns.",
}
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# As ``batchfit serve`` bounds it: oneDNN caches a compiled primitive per batch shape, and a
# job plans many shapes. Read by oneDNN at its first use, so set before the model loads.
ONEDNN_PRIMITIVE_CACHE_CAPACITY = "64"


def add_commands(commands: Any) -> None:
    """The bulk subcommands, on ``batchfit``'s subparsers."""
    for task, summary in COMMANDS.items():
        parser = commands.add_parser(
            task, help=summary, description=f"{summary} Rerunning the same command resumes: "
            "finished parts are skipped. See docs/bulk.md.",
        )  # fmt: skip
        parser.set_defaults(bulk_task=task)
        add_bulk_flags(parser, task)


def add_bulk_flags(parser: argparse.ArgumentParser, task: str) -> None:
    add = parser.add_argument
    add(
        "inputs",
        nargs="+",
        metavar="INPUT",
        help="Input files or globs (quote them): .jsonl, .csv, .tsv, .parquet or .txt (one "
        "text per line); several are read in the order given, each glob's matches sorted.",
    )
    add(
        "--out",
        required=True,
        metavar="DIR",
        help="Folder for the Parquet parts, manifest.json and rejects.jsonl.",
    )
    add(
        "--model",
        default=BUNDLED_MODEL,
        help="The bundled all-MiniLM-L6-v2, a local Hugging Face folder, a hub name "
        f"(safetensors only) or python:package.module:factory (default: {BUNDLED_MODEL}).",
    )
    add("--device", default="auto", help="cuda, cuda:N or cpu; auto picks CUDA if present.")
    add(
        "--dtype",
        default="auto",
        choices=("auto", "float32", "float16", "bfloat16"),
        help="Weights and activations dtype; auto is float16 on CUDA and float32 on CPU.",
    )
    add(
        "--quantize",
        default="none",
        choices=("none", "int8"),
        help="int8: torch dynamic quantization of the linear layers (CPU, float32 only).",
    )
    add(
        "--num-threads",
        type=int,
        default=None,
        help="torch intra-op threads on CPU; default: every CPU the process may use.",
    )
    add(
        "--max-input-tokens",
        type=int,
        default=None,
        help="Truncation length, at least 2; defaults to the model's own maximum, and a "
        "larger value is lowered to it (with a warning).",
    )
    add(
        "--prompt-name",
        default=None,
        help="The model's named prompt to put before every input (default: the model's "
        "default prompt, if it has one).",
    )
    if task == "embed":
        add(
            "--dimensions",
            type=int,
            default=None,
            help="Keep the first N dimensions of each embedding (Matryoshka models), "
            "renormalised where the model normalises.",
        )
    add(
        "--text-field",
        default="text",
        help="The field (JSON key, CSV or Parquet column) holding the text"
        + (" (the document, for reranking)" if task == "rerank" else "")
        + " (default: text).",
    )
    if task == "rerank":
        add(
            "--query-field",
            default="query",
            help="The field holding each row's query (default: query).",
        )
    add(
        "--id-field",
        default=None,
        help="The field holding each row's id (integers or strings); default: the row number, "
        "from 0 over every input in order.",
    )
    add(
        "--input-format",
        default=None,
        choices=FORMATS,
        help="Read every input as this format instead of telling it from the file name.",
    )
    add(
        "--part-rows",
        type=int,
        default=10_000,
        help="Input rows per Parquet part (default: 10000): the unit of resuming, and the "
        "window of inputs sorted by length that batches are cut from.",
    )
    add(
        "--max-batch-size",
        type=int,
        default=128,
        help="Most items in one forward pass (default: 128); within it the memory budget and "
        "the time model choose each batch.",
    )
    add(
        "--max-batch-tokens",
        type=int,
        default=4096,
        help="Most padded tokens (items x longest input) in one forward pass (default: 4096).",
    )
    add(
        "--memory-headroom",
        type=float,
        default=0.15,
        help="Share of the free memory the sizer leaves unused (default: 0.15).",
    )
    add(
        "--memory-limit",
        default=None,
        help="Most memory the job lets itself use (e.g. 2GiB): caps the batch budget, and on "
        "CPU also the address space once the model is loaded.",
    )
    add(
        "--strict",
        action="store_true",
        help="Stop at the first bad row instead of writing it to rejects.jsonl.",
    )
    add(
        "--overwrite",
        action="store_true",
        help="Start again: delete the parts, manifest and rejects already in --out.",
    )
    add(
        "--forward-timeout-s",
        type=float,
        default=300.0,
        help="Once warmed up, a forward pass running for longer than this, and ten times "
        "as long as the job's passes so far predict for it, means a hung device or model: "
        "every thread's stack is logged, the parts already computed are written and the job "
        "exits with status 3 (rerun to resume); 0: never (default: 300).",
    )
    add(
        "--progress",
        default="auto",
        choices=("auto", "bar", "log"),
        help="A live bar (on a terminal: auto) or a log line every --log-every-s.",
    )
    add(
        "--log-every-s",
        type=float,
        default=30.0,
        help="Seconds between progress lines when there is no bar (default: 30).",
    )
    add(
        "--log-level",
        default="info",
        choices=("debug", "info", "warning", "error"),
        help="Log level (default: info).",
    )


def spec_from_args(args: argparse.Namespace) -> JobSpec:
    memory_limit = None
    if args.memory_limit is not None:
        try:
            memory_limit = int(TypeAdapter(ByteSize).validate_python(args.memory_limit))
        except ValidationError:
            raise JobError(f"--memory-limit: not a size: {args.memory_limit!r}") from None
    return JobSpec(
        inputs=tuple(args.inputs), out=args.out, task=args.bulk_task, model=args.model,
        dtype=args.dtype, device=args.device, quantize=args.quantize,
        num_threads=args.num_threads, max_input_tokens=args.max_input_tokens,
        prompt_name=args.prompt_name, dimensions=getattr(args, "dimensions", None),
        text_field=args.text_field, id_field=args.id_field,
        query_field=getattr(args, "query_field", "query"), input_format=args.input_format,
        part_rows=args.part_rows, max_batch_size=args.max_batch_size,
        max_batch_tokens=args.max_batch_tokens, memory_headroom=args.memory_headroom,
        memory_limit=memory_limit, strict=args.strict, overwrite=args.overwrite,
        forward_timeout_s=args.forward_timeout_s,
    )  # fmt: skip


def bulk_command_line(argv: list[str], *, own_process: bool = False) -> int:
    """``batchfit embed|classify|rerank ...`` (``argv`` from the command's name on), parsed
    without the rest of ``batchfit``'s commands. ``own_process``: the process runs this job
    alone (``run_command``)."""
    parser = argparse.ArgumentParser(prog="batchfit")
    add_commands(parser.add_subparsers(dest="command", required=True))
    return run_command(parser.parse_args(argv), own_process=own_process)


def run_command(args: argparse.Namespace, *, own_process: bool = False) -> int:
    """Run the job ``args`` describe; 0 when it finished, 2 for a job that cannot run as
    given, 1 when it failed on the way, 3 when a forward pass hung and 130 when interrupted
    (rerun to resume, in both).
    ``own_process``: nothing else runs in this process, whose heap is then frozen out of
    garbage collection once the model is loaded (``run_job``'s ``freeze_heap``); a caller
    that goes on (a test) keeps its collector as it was."""
    command = f"batchfit {args.bulk_task}"
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", ONEDNN_PRIMITIVE_CACHE_CAPACITY)
    terminal = {"auto": None, "bar": True, "log": False}[args.progress]
    progress = Progress(terminal=terminal, log_every_s=args.log_every_s)
    handler = BarAwareHandler(progress)
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    logging.basicConfig(level=args.log_level.upper(), handlers=[handler], force=True)
    try:
        spec = spec_from_args(args)
        summary = run_job(spec, progress=progress, freeze_heap=own_process)
    except (JobError, ManifestMismatch, ReaderError, ModelError) as exc:
        print(f"{command}: {exc}", file=sys.stderr)
        return 2
    except (StrictReject, PartWriteError) as exc:
        print(f"{command}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{command}: interrupted; run the same command again to resume", file=sys.stderr)
        return 130
    print(summary.describe(), flush=True)
    return 0
