"""Bulk jobs end to end over a fake model: parts and their schema, bad rows, resuming after a
crash, refusing changed inputs, --strict, the tasks, and the command line."""

import logging

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchfit.cli import main
from bulk import JobError, JobSpec, ManifestMismatch, run_job
from bulk.pipeline import StrictReject
from tests.bulk_fakes import DIM, FakeEmbedder, expected_embedding


def write_jsonl(path, records):
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in records))
    return path


def corpus(n=95, bad=True):
    records = [{"text": " ".join(["w"] * (1 + (i * 7) % 40)) + f" {i}"} for i in range(n)]
    if bad:
        records[10] = {"body": "no text"}
        records[33] = {"text": ""}
    return records


def read_parts(out):
    return pa.concat_tables([pq.read_table(p) for p in sorted(out.glob("part-*.parquet"))])


def part_bytes(out):
    return [p.read_bytes() for p in sorted(out.glob("part-*.parquet"))]


def test_parts_hold_ids_and_embeddings_in_input_order_and_bad_rows_go_to_rejects(tmp_path):
    records = corpus()
    path = write_jsonl(tmp_path / "in.jsonl", records)
    summary = run_job(
        JobSpec((str(path),), str(tmp_path / "out"), part_rows=20), model=FakeEmbedder()
    )
    table = read_parts(tmp_path / "out")
    assert table.schema.field("id").type == pa.int64()
    assert table.schema.field("embedding").type == pa.list_(pa.float32(), DIM)
    good = [i for i in range(len(records)) if i not in (10, 33)]
    assert table["id"].to_pylist() == good
    for i, embedding in zip(good, table["embedding"].to_pylist(), strict=True):
        assert np.array_equal(np.float32(embedding), expected_embedding(records[i]["text"]))
    rejects = [
        orjson.loads(line) for line in (tmp_path / "out/rejects.jsonl").read_bytes().splitlines()
    ]
    assert rejects == [
        {"row": 10, "file": str(path), "line": 11, "reason": "missing field 'text'"},
        {"row": 33, "file": str(path), "line": 34, "reason": "empty text in field 'text'"},
    ]
    assert (summary.rows, summary.outputs, summary.rejects, summary.memory_rejects) == (
        95,
        93,
        2,
        0,
    )
    assert (summary.parts_written, summary.parts_skipped) == (5, 0)
    assert "93 outputs, 2 rejected (0 for memory)" in summary.describe()
    manifest = orjson.loads((tmp_path / "out/manifest.json").read_bytes())
    assert manifest["complete"] and manifest["rows"] == 95 and len(manifest["parts"]) == 5


def test_the_reader_thread_tokenizes_not_the_model_thread(tmp_path):
    path = write_jsonl(tmp_path / "in.jsonl", corpus(bad=False))
    model = FakeEmbedder()
    run_job(JobSpec((str(path),), str(tmp_path / "out"), part_rows=20), model=model)
    assert model.prepared_on == {"batchfit-read"}


def test_a_rerun_after_a_crash_skips_finished_parts_and_writes_the_same_bytes(tmp_path, caplog):
    path = write_jsonl(tmp_path / "in.jsonl", corpus())
    spec = JobSpec((str(path),), str(tmp_path / "whole"), part_rows=20)
    run_job(spec, model=FakeEmbedder())
    crashed = JobSpec((str(path),), str(tmp_path / "resumed"), part_rows=20)
    with pytest.raises(RuntimeError, match="crash"):
        run_job(crashed, model=FakeEmbedder(stop_after=5, interrupt=RuntimeError("crash")))
    finished = orjson.loads((tmp_path / "resumed/manifest.json").read_bytes())["parts"]
    assert 1 <= len(finished) < 5
    caplog.set_level(logging.INFO, logger="batchfit.bulk")
    model = FakeEmbedder()
    summary = run_job(crashed, model=model)
    assert part_bytes(tmp_path / "resumed") == part_bytes(tmp_path / "whole")
    assert (tmp_path / "resumed/rejects.jsonl").read_bytes() == (
        tmp_path / "whole/rejects.jsonl"
    ).read_bytes()
    assert summary.parts_skipped == len(finished)
    for part in finished:
        last = part["first_row"] + part["rows"] - 1
        assert f"part {part['index']} (rows {part['first_row']}-{last}) skipped" in caplog.text
    redone = {t for batch in model.batches for t in batch}
    assert len(redone) <= 20 * (5 - len(finished)), "only the parts not finished ran again"
    again = run_job(crashed, model=FakeEmbedder())
    assert (again.parts_skipped, again.parts_written, again.computed) == (5, 0, 0)


def test_inputs_changed_behind_a_finished_part_are_refused(tmp_path):
    records = corpus(bad=False)
    path = write_jsonl(tmp_path / "in.jsonl", records)
    spec = JobSpec((str(path),), str(tmp_path / "out"), part_rows=20)
    run_job(spec, model=FakeEmbedder())
    records[25]["text"] = records[25]["text"][:-1] + "X"  # same size, other text
    write_jsonl(path, records)
    with pytest.raises(ManifestMismatch, match=r"rows 20-39 \(part 1\) read differently now"):
        run_job(spec, model=FakeEmbedder())


def test_a_changed_model_is_refused(tmp_path):
    path = write_jsonl(tmp_path / "in.jsonl", corpus(bad=False))
    run_job(JobSpec((str(path),), str(tmp_path / "out")), model=FakeEmbedder())
    with pytest.raises(ManifestMismatch, match="model: 'fake' then, 'other' now"):
        run_job(JobSpec((str(path),), str(tmp_path / "out")), model=FakeEmbedder(name="other"))


def test_strict_stops_at_the_first_bad_row(tmp_path):
    path = write_jsonl(tmp_path / "in.jsonl", corpus())
    spec = JobSpec((str(path),), str(tmp_path / "out"), part_rows=20, strict=True)
    with pytest.raises(
        StrictReject, match=r"row 10 \(.*in\.jsonl, line 11\): missing field 'text'"
    ):
        run_job(spec, model=FakeEmbedder())


def test_string_ids_and_an_id_unlike_the_first(tmp_path):
    path = write_jsonl(tmp_path / "in.jsonl", [{"text": "a", "k": "x1"}, {"text": "b", "k": 2}])
    run_job(JobSpec((str(path),), str(tmp_path / "s"), id_field="k"), model=FakeEmbedder())
    assert read_parts(tmp_path / "s")["id"].to_pylist() == ["x1", "2"]
    path = write_jsonl(tmp_path / "in2.jsonl", [{"text": "a", "k": 1}, {"text": "b", "k": "x"}])
    run_job(JobSpec((str(path),), str(tmp_path / "i"), id_field="k"), model=FakeEmbedder())
    assert read_parts(tmp_path / "i")["id"].to_pylist() == [1]
    assert (
        b"is not an integer, as the first row's id is"
        in (tmp_path / "i/rejects.jsonl").read_bytes()
    )


def test_classify_and_rerank_write_their_own_columns(tmp_path):
    pairs = [("q1", "a"), ("q1", "bb"), ("query two", "ccc")]
    path = write_jsonl(tmp_path / "in.jsonl", [{"text": t, "query": q} for q, t in pairs])
    run_job(
        JobSpec((str(path),), str(tmp_path / "c"), task="classify"),
        model=FakeEmbedder(task="classify"),
    )
    table = read_parts(tmp_path / "c")
    assert table.column_names == ["id", "label", "score"]
    assert table["label"].to_pylist() == ["L1", "L2", "L0"]
    model = FakeEmbedder(task="rerank")
    run_job(JobSpec((str(path),), str(tmp_path / "r"), task="rerank"), model=model)
    table = read_parts(tmp_path / "r")
    assert table.column_names == ["id", "score"]
    # Each document with its own row's query: the fake scores the pair's encoded length.
    expected = [len(orjson.dumps([q, t]).decode()) / 1000 for q, t in pairs]
    assert table["score"].to_pylist() == pytest.approx(expected)


def test_a_model_of_another_task_is_refused_with_the_command_to_use(tmp_path):
    path = write_jsonl(tmp_path / "in.jsonl", corpus(bad=False))
    with pytest.raises(JobError, match="is a classify model; use batchfit classify"):
        run_job(JobSpec((str(path),), str(tmp_path / "out")), model=FakeEmbedder(task="classify"))


def test_the_command_line_runs_a_job_and_refuses_another_into_its_folder(tmp_path, capsys):
    path = write_jsonl(tmp_path / "in.jsonl", corpus())
    out = tmp_path / "out"
    args = ["embed", str(path), "--out", str(out), "--part-rows", "30", "--progress", "log"]
    assert main([*args, "--model", "python:tests.bulk_fakes:fake_embedder"]) == 0
    assert "done: 95 inputs" in capsys.readouterr().out
    assert len(list(out.glob("part-*.parquet"))) == 4
    assert main([*args, "--model", "python:tests.bulk_fakes:other_fake_embedder"]) == 2
    assert "holds the results of another job" in capsys.readouterr().err
    assert main(["classify", str(path), "--out", str(tmp_path / "c"),
                 "--model", "python:tests.bulk_fakes:fake_embedder"]) == 2  # fmt: skip
    assert "use batchfit embed" in capsys.readouterr().err
