"""Input files to rows: every format, several files and globs, ids, and bad rows' reasons."""

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from bulk.readers import (
    Fields,
    ReaderError,
    Reject,
    Row,
    check_fields,
    count_rows,
    expand_inputs,
    read_rows,
)


def rows_of(paths, fields=None, input_format=None):
    fields = fields or Fields()
    files = expand_inputs([str(p) for p in paths], input_format)
    check_fields(files, fields)
    return list(read_rows(files, fields)), files


def test_jsonl_rows_are_numbered_and_bad_ones_say_why(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_bytes(
        b'{"text": "first", "id": 7}\n'
        b"{not json\n"
        b'{"other": "x"}\n'
        b'{"text": ""}\n'
        b"\n"
        b'["text"]\n'
        b'{"text": 5}\n'
        b'{"text": "bad \xff byte"}\n'
        b'{"text": "last"}'
    )
    rows, _ = rows_of([path])
    assert rows[0] == Row(0, 0, "first", None, str(path), 1)
    rejects = {r.line: r.reason for r in rows if isinstance(r, Reject)}
    assert rejects[2].startswith("undecodable line")
    assert rejects[3] == "missing field 'text'"
    assert rejects[4] == "empty text in field 'text'"
    assert rejects[5] == "empty line"
    assert rejects[6] == "not a JSON object (list)"
    assert rejects[7] == "field 'text' is not a string (int)"
    assert rejects[8].startswith("undecodable line")
    assert rows[8] == Row(8, 8, "last", None, str(path), 9)
    assert [r.number for r in rows] == list(range(9))
    assert all(r.file == str(path) for r in rows)


def test_id_field_and_its_bad_values(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text('{"text": "a", "key": "doc-1"}\n{"text": "b"}\n{"text": "c", "key": 1.5}\n')
    rows, _ = rows_of([path], Fields(id="key"))
    assert rows[0].id == "doc-1"
    assert rows[1].reason == "missing field 'key'"
    assert rows[2].reason == "id field 'key' is neither a string nor an integer"


def test_csv_with_quoted_newlines_short_rows_and_undecodable_lines(tmp_path):
    path = tmp_path / "a.csv"
    path.write_bytes(b'id,text\n1,"two\nlines"\n2\n3,\xff\xfe\n\n4,plain\n')
    rows, _ = rows_of([path], Fields(id="id"))
    assert rows[0] == Row(0, "1", "two\nlines", None, str(path), 2)
    assert (rows[1].line, rows[1].reason) == (4, "missing field 'text'")
    assert rows[2].line == 5 and rows[2].reason.startswith("undecodable line")
    assert (rows[3].line, rows[3].reason) == (6, "empty line")
    assert rows[4] == Row(4, "4", "plain", None, str(path), 7)


def test_tsv_text_and_parquet(tmp_path):
    (tmp_path / "a.tsv").write_text("text\tn\nhello\t1\n")
    (tmp_path / "b.txt").write_bytes("\ufeffone\n\ntwo\r\n".encode())  # with a BOM
    pq.write_table(pa.table({"text": ["p1", None, "p3"], "n": [1, 2, 3]}), tmp_path / "c.parquet")
    rows, files = rows_of([tmp_path / "a.tsv", tmp_path / "b.txt", tmp_path / "c.parquet"])
    assert [f.format for f in files] == ["tsv", "text", "parquet"]
    texts = [r.text if isinstance(r, Row) else r.reason for r in rows]
    assert texts == ["hello", "one", "empty text in field 'text'", "two", "p1",
                     "missing field 'text'", "p3"]  # fmt: skip
    assert [r.line for r in rows] == [2, 1, 2, 3, 1, 2, 3]
    assert [r.number for r in rows] == list(range(7))
    assert count_rows(files) == 7


def test_several_files_and_globs_in_the_order_given(tmp_path):
    for name in ("b.jsonl", "a.jsonl", "c.jsonl"):
        (tmp_path / name).write_text(f'{{"text": "{name}"}}\n')
    rows, _ = rows_of([tmp_path / "c.jsonl", tmp_path / "[ab].jsonl"])
    assert [r.text for r in rows] == ["c.jsonl", "a.jsonl", "b.jsonl"]
    assert [r.id for r in rows] == [0, 1, 2]


def test_a_missing_column_is_refused_before_anything_runs(tmp_path):
    (tmp_path / "a.csv").write_text("id,body\n1,x\n")
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "b.parquet")
    for name in ("a.csv", "b.parquet"):
        files = expand_inputs([str(tmp_path / name)])
        with pytest.raises(ReaderError, match=r"has no column 'text' \(its columns: .*body"):
            check_fields(files, Fields())


@pytest.mark.parametrize(
    ("patterns", "message"),
    [
        (["missing.jsonl"], "no such file"),
        (["*.nothing"], "no file matches"),
        (["a.bin"], "cannot tell the format"),
        (["a.jsonl", "a.jsonl"], "named twice"),
    ],
)
def test_inputs_that_cannot_be_read(tmp_path, monkeypatch, patterns, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.jsonl").write_text('{"text": "x"}\n')
    (tmp_path / "a.bin").write_text("x\n")
    with pytest.raises(ReaderError, match=message):
        expand_inputs(patterns)


def test_plain_text_has_no_fields_to_name(tmp_path):
    (tmp_path / "a.txt").write_text("x\n")
    with pytest.raises(ReaderError, match="plain text"):
        rows_of([tmp_path / "a.txt"], Fields(id="id"))


def test_input_format_overrides_the_suffix(tmp_path):
    (tmp_path / "a.data").write_text('{"text": "x"}\n')
    rows, _ = rows_of([tmp_path / "a.data"], input_format="jsonl")
    assert rows[0].text == "x"
