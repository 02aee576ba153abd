"""The output folder's manifest: resuming the same job, refusing another, dropping what a
killed run left half done."""

import dataclasses

import pytest

from bulk.manifest import MANIFEST, REJECTS, Manifest, ManifestMismatch, PartRecord
from bulk.writer import append_rejects, write_atomically

JOB = {"task": "embed", "model": "m", "model_sha256": "abc", "dtype": "float32"}
INPUTS = [{"path": "/data/a.jsonl", "format": "jsonl", "size_bytes": 100}]


def finish_part(manifest: Manifest, index: int, data: bytes = b"parquet bytes") -> PartRecord:
    written = write_atomically(manifest.directory, f"part-{index:05d}.parquet", data)
    rejects = append_rejects(manifest.directory / REJECTS, [{"row": index, "reason": "x"}])
    record = PartRecord(
        index=index, file=written.name, first_row=10 * index, rows=10, outputs=9, rejects=1,
        input_sha256="in", size_bytes=written.size_bytes, sha256=written.sha256,
        rejects_bytes=rejects,
    )  # fmt: skip
    manifest.record(record)
    return record


def test_a_rerun_of_the_same_job_keeps_its_finished_parts(tmp_path):
    manifest = Manifest.open(tmp_path, JOB, INPUTS)
    first = finish_part(manifest, 0)
    finish_part(manifest, 1)
    manifest.close()
    again = Manifest.open(tmp_path, dict(JOB), [dict(i) for i in INPUTS])
    assert [p.index for p in again.parts] == [0, 1]
    assert again.part(0) == first and again.part(2) is None
    assert again.rejects_bytes == (tmp_path / REJECTS).stat().st_size


def test_what_a_killed_run_left_unlisted_is_dropped(tmp_path):
    manifest = Manifest.open(tmp_path, JOB, INPUTS)
    finish_part(manifest, 0)
    kept_rejects = (tmp_path / REJECTS).stat().st_size
    # Killed after writing part 1's file and its rejects, before the manifest listed it,
    # and in the middle of writing part 2.
    (tmp_path / "part-00001.parquet").write_bytes(b"unlisted")
    append_rejects(tmp_path / REJECTS, [{"row": 15, "reason": "x"}])
    (tmp_path / ".part-00002.parquet.tmp").write_bytes(b"half")
    manifest.close()
    again = Manifest.open(tmp_path, JOB, INPUTS)
    assert [p.index for p in again.parts] == [0]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(("part", ".part"))) == [
        "part-00000.parquet"
    ]
    assert (tmp_path / REJECTS).stat().st_size == kept_rejects


def test_a_damaged_part_and_every_one_after_it_are_redone(tmp_path):
    manifest = Manifest.open(tmp_path, JOB, INPUTS)
    for index in range(3):
        finish_part(manifest, index)
    manifest.close()
    (tmp_path / "part-00001.parquet").write_bytes(b"cut")
    again = Manifest.open(tmp_path, JOB, INPUTS)
    assert [p.index for p in again.parts] == [0]
    assert not (tmp_path / "part-00002.parquet").exists()


@pytest.mark.parametrize(
    ("job", "inputs", "message"),
    [
        ({**JOB, "model_sha256": "def"}, INPUTS, "another job.*sha256: 'abc' then, 'def' now"),
        ({**JOB, "dtype": "bfloat16"}, INPUTS, "dtype: 'float32' then, 'bfloat16' now"),
        (JOB, [{**INPUTS[0], "size_bytes": 101}], "inputs changed.*was 100 bytes, now 101"),
        (JOB, [{**INPUTS[0], "path": "/data/b.jsonl"}], "a.jsonl is gone; /data/b.jsonl is new"),
    ],
)  # fmt: skip
def test_another_job_or_other_inputs_are_refused(tmp_path, job, inputs, message):
    manifest = Manifest.open(tmp_path, JOB, INPUTS)
    finish_part(manifest, 0)
    manifest.close()
    with pytest.raises(ManifestMismatch, match=message) as refused:
        Manifest.open(tmp_path, job, inputs)
    assert "--overwrite" in str(refused.value)
    assert (tmp_path / "part-00000.parquet").exists(), "a refused run deletes nothing"


def test_overwrite_starts_again(tmp_path):
    manifest = Manifest.open(tmp_path, JOB, INPUTS)
    finish_part(manifest, 0)
    manifest.close()
    fresh = Manifest.open(tmp_path, {**JOB, "model": "other"}, INPUTS, overwrite=True)
    assert fresh.parts == [] and not (tmp_path / "part-00000.parquet").exists()
    assert (tmp_path / REJECTS).read_bytes() == b""


def test_part_files_without_a_manifest_are_not_taken_over(tmp_path):
    (tmp_path / "part-00000.parquet").write_bytes(b"someone's")
    with pytest.raises(ManifestMismatch, match=r"part files but no manifest\.json"):
        Manifest.open(tmp_path, JOB, INPUTS)


def test_two_jobs_never_write_into_one_folder(tmp_path):
    manifest = Manifest.open(tmp_path, JOB, INPUTS)
    with pytest.raises(ManifestMismatch, match="another job is writing"):
        Manifest.open(tmp_path, JOB, INPUTS)
    manifest.close()
    Manifest.open(tmp_path, JOB, INPUTS).close()


def test_parts_are_recorded_in_order_and_the_file_is_rewritten_whole(tmp_path):
    manifest = Manifest.open(tmp_path, JOB, INPUTS)
    record = finish_part(manifest, 0)
    with pytest.raises(RuntimeError, match="part 2 recorded after 1 parts"):
        manifest.record(dataclasses.replace(record, index=2))
    manifest.finish(10)
    assert not list(tmp_path.glob(".*.tmp"))
    assert b'"complete": true' in (tmp_path / MANIFEST).read_bytes()
