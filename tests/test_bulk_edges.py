"""Bulk jobs at their edges: CSV records with a bad line inside, TSV without quoting, long CSV
fields, ids past int64, parts with no outputs, globs over the output folder, flags out of
range and unreadable inputs, a part that cannot be written, a part damaged in place."""

import csv
import errno
import glob
import logging

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import bulk.job
import bulk.pipeline
from bulk import JobSpec, run_job
from bulk.cli import bulk_command_line
from bulk.readers import (
    Fields,
    ReaderError,
    Reject,
    Row,
    check_fields,
    count_rows,
    expand_inputs,
    read_rows,
    row_problem,
)
from tests.bulk_fakes import FakeEmbedder

FAKE = "python:tests.bulk_fakes:fake_embedder"


def rows_of(paths, fields=None):
    fields = fields or Fields()
    files = expand_inputs([str(p) for p in paths])
    check_fields(files, fields)
    return list(read_rows(files, fields)), files


def write_jsonl(path, records):
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in records))
    return path


def command(*args):
    """The command line in this process: its exit status."""
    return bulk_command_line([*args, "--progress", "log", "--log-level", "warning"])


@pytest.fixture
def no_model_load(monkeypatch):
    """A job refused before its model loads never calls ``load_model``."""

    def refuse(spec):
        raise AssertionError("the model was loaded before the job was refused")

    monkeypatch.setattr(bulk.job, "load_model", refuse)


def test_a_bad_line_inside_a_quoted_csv_field_rejects_its_whole_record(tmp_path):
    path = tmp_path / "mid.csv"
    path.write_bytes(b'text\nfirst\n"second line one\nmiddle \xff bad\nlast part"\nthird\n')
    rows, _ = rows_of([path])
    assert rows[0] == Row(0, 0, "first", None, str(path), 2)
    assert isinstance(rows[1], Reject)
    assert (rows[1].number, rows[1].line) == (1, 3)
    assert rows[1].reason.startswith("undecodable line 4: 'utf-8' codec can't decode byte 0xff")
    assert rows[2] == Row(2, 2, "third", None, str(path), 6)
    assert len(rows) == 3


def test_tsv_has_no_quoting(tmp_path):
    path = tmp_path / "q.tsv"
    path.write_text(
        'id\ttext\n1\t"Hello" world\n2\t"unclosed quote at the start\n3\tthird\n4\tfourth\n'
    )
    rows, files = rows_of([path], Fields(id="id"))
    assert [(r.id, r.text) for r in rows] == [
        ("1", '"Hello" world'),
        ("2", '"unclosed quote at the start'),
        ("3", "third"),
        ("4", "fourth"),
    ]
    assert count_rows(files) == 4


def test_a_csv_field_past_128_kib_is_read_whole(tmp_path):
    previous = csv.field_size_limit(128 * 1024)  # Python's default, whatever ran before
    try:
        path = tmp_path / "long.csv"
        text = "word " * 60_000  # 300,000 characters
        path.write_text(f"text\n{text}\nshort\n")
        rows, _ = rows_of([path])
    finally:
        csv.field_size_limit(max(previous, csv.field_size_limit()))
    assert [r.text for r in rows] == [text, "short"]


def test_an_integer_id_outside_int64_is_a_bad_row_not_a_crash(tmp_path):
    fields = Fields(id="id")
    assert row_problem({"text": "a", "id": -(2**63)}, fields) is None
    assert row_problem({"text": "a", "id": 2**63 - 1}, fields) is None
    assert row_problem({"text": "a", "id": 2**63}, fields) == (
        "id 9223372036854775808 in field 'id' is outside the 64-bit integer range"
    )
    path = tmp_path / "in.jsonl"
    path.write_bytes(
        b'{"id": 1, "text": "a"}\n'
        b'{"id": 9223372036854775808, "text": "b"}\n'
        b'{"id": 3, "text": "c"}\n'
    )
    out = tmp_path / "out"
    summary = run_job(JobSpec((str(path),), str(out), id_field="id"), model=FakeEmbedder())
    assert (summary.outputs, summary.rejects) == (2, 1)
    assert pq.read_table(out / "part-00000.parquet")["id"].to_pylist() == [1, 3]
    reject = orjson.loads((out / "rejects.jsonl").read_bytes())
    assert (reject["row"], reject["reason"]) == (1, row_problem({"text": "b", "id": 2**63}, fields))


def test_a_part_that_cannot_be_written_ends_the_job_with_one_line(tmp_path, monkeypatch, capsys):
    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(bulk.pipeline, "write_atomically", full_disk)
    path = write_jsonl(tmp_path / "in.jsonl", [{"text": f"row {i}"} for i in range(30)])
    status = command("embed", str(path), "--out", str(tmp_path / "out"), "--model", FAKE,
                     "--part-rows", "10")  # fmt: skip
    err = capsys.readouterr().err
    assert status == 1
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1] == (
        "batchfit embed: part 0 (rows 0-9) could not be written: OSError: [Errno 28] No space "
        "left on device"
    )


def test_a_part_of_rejected_rows_writes_no_file_and_the_parts_read_as_one_table(tmp_path):
    path = write_jsonl(
        tmp_path / "idmix.jsonl",
        [{"id": "a1"}, {"id": "a2", "text": ""}, {"id": "b1", "text": "hello"},
         {"id": "b2", "text": "world"}],
    )  # fmt: skip
    out = tmp_path / "out"
    spec = JobSpec((str(path),), str(out), id_field="id", part_rows=2)
    summary = run_job(spec, model=FakeEmbedder())
    assert (summary.outputs, summary.rejects, summary.parts_written) == (2, 2, 2)
    # As docs/bulk.md reads them.
    table = pq.read_table(sorted(glob.glob(f"{out}/part-*.parquet")))
    assert table.schema.field("id").type == pa.string()
    assert table["id"].to_pylist() == ["b1", "b2"]
    parts = orjson.loads((out / "manifest.json").read_bytes())["parts"]
    assert [p["file"] for p in parts] == [None, "part-00001.parquet"]
    assert (parts[0]["rows"], parts[0]["outputs"], parts[0]["rejects"]) == (2, 0, 2)
    again = run_job(spec, model=FakeEmbedder())
    assert (again.parts_skipped, again.parts_written, again.computed) == (2, 0, 0)
    assert (again.outputs, again.rejects) == (2, 2)


def test_a_glob_over_the_output_folder_leaves_the_jobs_own_files_out(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    write_jsonl(data / "corpus.jsonl", [{"text": f"row {i}"} for i in range(5)] + [{"x": 1}])
    out = data / "out"
    spec = JobSpec((str(data / "**" / "*.json*"),), str(out), part_rows=2)
    first = run_job(spec, model=FakeEmbedder())
    assert (out / "rejects.jsonl").stat().st_size > 0 and (out / "manifest.json").exists()
    again = run_job(spec, model=FakeEmbedder())
    assert (again.parts_skipped, again.parts_written) == (first.parts_written, 0)
    with pytest.raises(ReaderError, match=r"no file outside .*out matches"):
        expand_inputs([str(out / "*")], exclude=str(out))


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--max-batch-size", "0"], "--max-batch-size must be at least 1, got 0"),
        (["--max-batch-tokens", "0"], "--max-batch-tokens must be at least 1, got 0"),
        (["--memory-headroom", "1.5"], "--memory-headroom must be from 0 to less than 1, got 1.5"),
        (["--num-threads", "0"], "--num-threads must be at least 1, got 0"),
        (["--max-input-tokens", "-5"], "--max-input-tokens must be at least 2, got -5"),
        (["--max-input-tokens", "0"], "--max-input-tokens must be at least 2, got 0"),
        (["--part-rows", "0"], "--part-rows must be at least 1, got 0"),
        (["--memory-limit", "0"], "--memory-limit must be at least 1, got 0"),
    ],
)
def test_flags_out_of_range_are_refused_before_the_model_loads(
    tmp_path, capsys, no_model_load, flags, message
):
    path = write_jsonl(tmp_path / "in.jsonl", [{"text": "a"}])
    assert command("embed", str(path), "--out", str(tmp_path / "out"), *flags) == 2
    assert capsys.readouterr().err.strip() == f"batchfit embed: {message}"
    assert not (tmp_path / "out").exists()


def test_an_out_that_is_a_file_is_refused_before_the_model_loads(tmp_path, capsys, no_model_load):
    path = write_jsonl(tmp_path / "in.jsonl", [{"text": "a"}])
    (tmp_path / "afile").write_text("")
    assert command("embed", str(path), "--out", str(tmp_path / "afile")) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"batchfit embed: --out {tmp_path / 'afile'} is a file, not a folder"


def test_a_parquet_input_that_is_not_parquet_is_refused_with_one_line(
    tmp_path, capsys, no_model_load
):
    path = tmp_path / "notparquet.parquet"
    path.write_bytes(b"this is not parquet at all\n" * 10)
    assert command("embed", str(path), "--out", str(tmp_path / "out")) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"batchfit embed: {path} is not a readable Parquet file: ")
    assert len(err.splitlines()) == 1


def test_max_input_tokens_above_the_models_is_lowered_with_a_warning(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="batchfit.bulk")
    path = write_jsonl(tmp_path / "in.jsonl", [{"text": "a"}])
    spec = JobSpec((str(path),), str(tmp_path / "out"), max_input_tokens=100_000)
    run_job(spec, model=FakeEmbedder(max_input_tokens=64))
    assert (
        "--max-input-tokens 100000 is above the most model 'fake' takes; inputs are truncated "
        "at its maximum, 64 tokens" in caplog.text
    )


def test_a_part_damaged_in_place_at_the_same_size_is_redone(tmp_path, caplog):
    path = write_jsonl(tmp_path / "in.jsonl", [{"text": f"row {i}"} for i in range(50)])
    out = tmp_path / "out"
    spec = JobSpec((str(path),), str(out), part_rows=10)
    run_job(spec, model=FakeEmbedder())
    whole = [p.read_bytes() for p in sorted(out.glob("part-*.parquet"))]
    damaged = bytearray(whole[2])
    damaged[len(damaged) // 2] ^= 0xFF
    (out / "part-00002.parquet").write_bytes(bytes(damaged))
    caplog.set_level(logging.WARNING, logger="batchfit.bulk")
    again = run_job(spec, model=FakeEmbedder())
    assert "part 2 (part-00002.parquet) is missing or damaged; it is redone" in caplog.text
    assert (again.parts_skipped, again.parts_written) == (2, 3)
    assert [p.read_bytes() for p in sorted(out.glob("part-*.parquet"))] == whole
