from __future__ import annotations

import hashlib
import itertools
import json
import os
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import write_records
from shardcache import BadRecordError, SourceError
from shardcache.builder.sources import FileDigest, iter_text_batches, list_inputs


def _collect(file, **kw):
    bad = []
    texts, records = [], []
    for batch in iter_text_batches(file, on_bad=lambda *a: bad.append(a), **kw):
        texts += batch.texts
        records += batch.records.tolist()
    return texts, records, bad


def test_inputs_sorted_relative_and_deduplicated(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "a").mkdir()
    for rel in ["b/2.jsonl", "a/1.jsonl.zst", "a/0.parquet", "b/x.json.gz"]:
        write_records(str(tmp_path / rel), [{"text": "hi"}], rel.split(".", 1)[1])
    (tmp_path / "a" / "notes.txt").write_text("ignored")
    files = list_inputs([str(tmp_path), str(tmp_path / "a" / "*.parquet")])
    assert [f.relpath for f in files] == [
        "a/0.parquet",
        "a/1.jsonl.zst",
        "b/2.jsonl",
        "b/x.json.gz",
    ]
    assert [f.format for f in files] == ["parquet", "jsonl.zst", "jsonl", "json.gz"]


def test_missing_inputs_are_clear_errors(tmp_path):
    with pytest.raises(SourceError, match="no such file"):
        list_inputs([str(tmp_path / "nope.jsonl")])
    with pytest.raises(SourceError, match="matches no file"):
        list_inputs([str(tmp_path / "*.jsonl")])
    (tmp_path / "x.docx").write_text("t")  # (.txt is a format now: one document per file)
    with pytest.raises(SourceError, match="unknown format"):
        list_inputs([str(tmp_path / "x.docx")])


@pytest.mark.parametrize("fmt", ["jsonl", "jsonl.zst", "json.gz"])
def test_bad_records_reported_by_reason_with_line_numbers(tmp_path, fmt):
    lines = [
        b'{"text": "good one"}',
        b'{"text": "unterminated',
        b'{"body": "no text"}',
        b'{"text": 12345}',
        b'{"text": "broken \xff\xfe bytes"}',
        b'{"text": ""}',
        b"[1, 2]",
        b"",
        b'{"text": "good two"}',
    ]
    raw = b"\n".join(lines) + b"\n"
    path = tmp_path / f"x.{fmt}"
    if fmt == "jsonl.zst":
        import zstandard

        raw_file = zstandard.ZstdCompressor().compress(raw)
    elif fmt == "json.gz":
        import gzip

        raw_file = gzip.compress(raw)
    else:
        raw_file = raw
    path.write_bytes(raw_file)
    [file] = list_inputs([str(path)])
    digest = FileDigest()
    texts, records, bad = _collect(file, digest=digest)
    assert texts == ["good one", "good two"] and records == [0, 8]
    assert [(i, reason) for i, reason, _ in bad] == [
        (1, "not_json"),
        (2, "no_text_field"),
        (3, "text_not_string"),
        (4, "invalid_utf8"),
        (5, "empty_text"),
        (6, "not_an_object"),
        (7, "blank_line"),
    ]
    assert digest.sha256 == hashlib.sha256(raw_file).hexdigest()
    with pytest.raises(BadRecordError, match=rf"x\.{fmt}: line 2 is invalid \(not_json\)"):
        _collect(file, on_error="fail")


def test_parquet_rows_and_missing_column(tmp_path):
    path = write_records(
        str(tmp_path / "p.parquet"), [{"text": "a"}, {"text": None}, {"text": "c"}], "parquet"
    )
    [file] = list_inputs([path])
    texts, records, bad = _collect(file, batch_docs=1)
    assert texts == ["a", "c"] and records == [0, 2] and bad[0][:2] == (1, "no_text_field")
    # a missing column makes every row a bad record, as a missing field does in jsonl
    texts, records, bad = _collect(file, text_field="body")
    assert texts == [] and [b[:2] for b in bad] == [(i, "no_text_field") for i in range(3)]
    with pytest.raises(SourceError, match="no_text_field"):
        _collect(file, text_field="body", on_error="fail")


def test_corrupt_zst_names_file_and_offset(tmp_path):
    import zstandard

    data = b"".join(b'{"text": "doc %d"}\n' % i for i in range(20000))
    blob = zstandard.ZstdCompressor().compress(data)
    path = tmp_path / "broken.jsonl.zst"
    path.write_bytes(blob[: len(blob) // 2])
    [file] = list_inputs([str(path)])
    with pytest.raises(SourceError, match=r"broken\.jsonl\.zst: cannot decompress .* offset"):
        _collect(file)


def test_batches_respect_batch_docs(tmp_path):
    path = write_records(str(tmp_path / "a.jsonl"), [{"text": str(i)} for i in range(10)], "jsonl")
    [file] = list_inputs([path])
    sizes = [len(b.texts) for b in iter_text_batches(file, batch_docs=4)]
    assert sizes == [4, 4, 2]
    assert os.path.getsize(path) == file.size


@pytest.mark.parametrize("fmt", ["jsonl", "jsonl.zst"])
def test_a_reader_that_stops_after_one_batch_parses_no_further(tmp_path, fmt):
    # the gate's sample takes a few documents per file: the rest of the read block (a bad
    # record here) is neither parsed nor reported
    records: list = [{"text": f"doc {i}"} for i in range(5)] + ["not json"] + [{"text": "x"}]
    path = write_records(str(tmp_path / f"a.{fmt}"), records, fmt)
    [file] = list_inputs([path])
    bad: list = []
    batches = iter_text_batches(file, batch_docs=2, on_bad=lambda *a: bad.append(a))
    first = next(batches)
    batches.close()
    assert first.texts == ["doc 0", "doc 1"] and bad == []
    _, records_read, bad_all = _collect(file, batch_docs=2)
    assert records_read == [0, 1, 2, 3, 4, 6] and len(bad_all) == 1


@settings(max_examples=40, deadline=None)
@given(
    lines=st.lists(st.one_of(st.just(""), st.text(alphabet="ab\u00e9 ", max_size=40)), max_size=60),
    trailing_newline=st.booleans(),
    size=st.integers(min_value=1, max_value=300),
)
def test_split_lines_cover_the_file_at_line_boundaries(lines, trailing_newline, size):
    import tempfile

    from shardcache.builder.inputs.jsonl import _split_lines
    from shardcache.builder.sources import InputFile

    raw = "\n".join(lines).encode() + (b"\n" if trailing_newline and lines else b"")
    with tempfile.NamedTemporaryFile(suffix=".jsonl") as f:
        f.write(raw)
        f.flush()
        file = InputFile(f.name, "x.jsonl", len(raw), "jsonl")
        spans, sha = _split_lines(file, size)
    assert sha == hashlib.sha256(raw).hexdigest()
    assert spans[0].start == 0 and spans[-1].end is None
    for a, b in itertools.pairwise(spans):
        assert a.end == b.start and a.start < a.end  # contiguous, non-empty
        assert raw[b.start - 1 : b.start] == b"\n"  # cut just after a newline
        assert b.first_record == raw[: b.start].count(b"\n")  # file-global line number


def test_slices_read_the_same_records_as_the_whole_file(tmp_path):
    from shardcache.builder.sources import split_input

    records = [{"text": f"doc {i} " + "x" * (i % 37)} if i % 9 else {"body": 1} for i in range(300)]
    path = write_records(str(tmp_path / "a.jsonl"), records, "jsonl")
    [file] = list_inputs([path])
    whole_texts, whole_records, whole_bad = _collect(file)
    spans, sha = split_input(file, 1024)
    with open(path, "rb") as f:
        assert len(spans) > 5 and sha == hashlib.sha256(f.read()).hexdigest()
    texts, recs, bad = [], [], []
    for span in spans:
        t, r, b = _collect(file, part=span)
        texts += t
        recs += r
        bad += b
    assert (texts, recs, bad) == (whole_texts, whole_records, whole_bad)


def test_batches_are_bounded_by_characters(tmp_path, monkeypatch):
    import shardcache.builder.inputs.base as sources

    monkeypatch.setattr(sources, "MAX_BATCH_CHARS", 100)
    texts = ["x" * 30] * 7 + ["y" * 500] + ["z"]
    path = write_records(str(tmp_path / "a.jsonl"), [{"text": t} for t in texts], "jsonl")
    [file] = list_inputs([path])
    sizes = [len(b.texts) for b in iter_text_batches(file, batch_docs=1000)]
    assert sizes == [3, 3, 1, 1, 1]  # at most 100 chars, except a huge document alone


def test_truncated_zst_with_skip_reports_and_keeps_the_prefix(tmp_path):
    import zstandard

    data = b"".join(b'{"text": "doc %d"}\n' % i for i in range(20000))
    blob = zstandard.ZstdCompressor().compress(data)
    path = tmp_path / "broken.jsonl.zst"
    path.write_bytes(blob[: len(blob) // 2])
    [file] = list_inputs([str(path)])
    corrupt = []
    texts, records, _ = _collect(file, on_corrupt=lambda *a: corrupt.append(a))
    [(record, offset, message)] = corrupt
    assert records == list(range(len(records))) and record == len(records) > 0
    assert texts[-1] == f"doc {record - 1}" and offset > 0 and "broken.jsonl.zst" in message


def test_the_plan_hashes_every_byte_range_it_cuts(corpus):
    """Each slice of a split jsonl file carries the sha256 of its byte range, so the partition
    that reads it can tell whether it read the planned bytes."""
    import hashlib

    from shardcache.builder.sources import list_inputs, split_input

    folder, _ = corpus("jsonl", n_files=1, docs=300)
    [file] = list_inputs([folder])
    slices, whole = split_input(file, 4096)
    assert len(slices) > 3
    with open(file.path, "rb") as f:
        data = f.read()
    assert whole == hashlib.sha256(data).hexdigest()
    for s in slices:
        assert s.sha256 == hashlib.sha256(data[s.start : s.end]).hexdigest()


#: JSON lines of every kind the reader classifies: valid texts (escapes, pairs of surrogates,
#: CJK, emoji, combining marks, control escapes, duplicate keys), and each kind of bad line
#: json and orjson might judge differently (NaN, big integers, lone surrogates, raw control
#: characters, invalid UTF-8, nesting around json's limit, trailing garbage, not an object).
ORJSON_EDGE_LINES = [
    b'{"text": "plain"}',
    b'{"text": "a\\nb\\t\\u00e9\\ud83d\\ude00 \\u4e2d\\u6587 e\\u0301"}',
    '{"text": "中文 🙂 é x̧"}'.encode(),
    b'{"text": "first", "text": "last"}',
    b'{"text": "x", "n": NaN}',
    b'{"text": "x", "n": 123456789012345678901234567890}',
    b'{"text": "x", "n": ' + b"1" * 5000 + b"}",
    b'{"text": "x", "n": 1e400}',
    b'{"text": "\\ud800 lone"}',
    b'{"text": "raw\x01control"}',
    b'{"text": "bad \xff utf8"}',
    b'{"text": "ok", "deep": ' + b"[" * 200 + b"]" * 200 + b"}",
    b'{"text": "ok", "deep": ' + b"[" * 1000 + b"]" * 1000 + b"}",
    b'{"text": "ok", "deep": ' + b"[" * 1020 + b"]" * 1020 + b"}",
    b'{"text": "ok"} trailing',
    b'"just a string"',
    b'{"text": 5}',
    b'{"text": ""}',
    b'{"other": "x"}',
    b'{"text": null}',
    b"   ",
    b'  {"text": "spaced"}  \r',
    b'{"text": "code {[()]} ' + b"{[" * 300 + b'"}',
]


@pytest.mark.parametrize("kind", ["text", "chat"])
def test_orjson_and_json_read_the_same_records_and_reasons(tmp_path, monkeypatch, kind):
    import shardcache.builder.inputs.jsonl as sources

    pytest.importorskip("orjson")
    lines = list(ORJSON_EDGE_LINES)
    if kind == "chat":
        lines += [
            b'{"text": [{"role": "user", "content": "hi \\ud83d\\ude00"}]}',
            b'{"text": [{"role": "user", "content": "\\udc00"}]}',
            b'{"text": [{"role": "user"}]}',
        ]
    path = tmp_path / "edge.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    (file,) = list_inputs([str(path)])
    fast = _collect(file, kind=kind)
    monkeypatch.setattr(sources, "_orjson_loads", None)
    reference = _collect(file, kind=kind)
    assert fast == reference
    if kind == "text":
        assert len(fast[0]) >= 6 and len(fast[2]) >= 10  # both kinds of line are there


def test_batches_of_small_files_join_up_to_the_batch_size_with_each_texts_file():
    import numpy as np

    from shardcache.builder.sources import TextBatch, join_batches

    batches = [TextBatch([f"t{k}.{i}" for i in range(n)], np.arange(n, dtype=np.int64), f"f{k}")
               for k, n in enumerate([1, 2, 1, 3, 1])]  # fmt: skip
    joined = list(join_batches(batches, batch_docs=4))
    assert [b.texts for b in joined] == [
        ["t0.0", "t1.0", "t1.1", "t2.0"],
        ["t3.0", "t3.1", "t3.2", "t4.0"],
    ]
    first = joined[0]
    assert first.records.tolist() == [0, 0, 1, 0]
    assert [first.source_of(d) for d in range(4)] == ["f0", "f1", "f1", "f2"]
    assert first.runs(np.array([0, 1, 2, 3])) == [("f0", 0, 1), ("f1", 1, 3), ("f2", 3, 4)]
    assert first.runs(np.array([1, 3])) == [("f1", 0, 1), ("f2", 1, 2)]
    kept = first.take([1, 3])  # e.g. without records the tokenizer failed on
    assert kept.texts == ["t1.0", "t2.0"] and [kept.source_of(d) for d in (0, 1)] == ["f1", "f2"]
    # a batch that is full already passes alone, unchanged
    [alone] = join_batches([batches[3]], batch_docs=2)
    assert (
        alone is batches[3] and alone.files is None and alone.runs(np.arange(3)) == [("f3", 0, 3)]
    )


@pytest.mark.parametrize("fmt", ["jsonl", "jsonl.zst"])
@pytest.mark.parametrize("chunk", [5, 64, 1 << 20])
def test_lines_across_read_blocks_read_as_line_by_line(tmp_path, monkeypatch, fmt, chunk):
    """Records are cut from whole blocks of decoded bytes: a line split over blocks (or
    longer than many), blank and CRLF lines, a BOM and a last line without its newline read
    as the line-by-line ``json`` path reads them."""
    import zstandard

    import shardcache.builder.inputs.jsonl as sources

    pytest.importorskip("orjson")
    long = b'{"text": "' + b"long line " * 300 + b'"}'
    lines = [b'\xef\xbb\xbf{"text": "after a BOM"}', long, b"", b'{"text": "crlf"}\r', b"\r"]
    lines += [*ORJSON_EDGE_LINES, long, b'{"text": "meta", "m": {"a": [1, {"b": 2}]}}']
    raw = b"\n".join(lines) + b'\n{"text": "no newline at the end"}'
    path = tmp_path / f"blocks.{fmt}"
    path.write_bytes(zstandard.ZstdCompressor().compress(raw) if fmt == "jsonl.zst" else raw)
    (file,) = list_inputs([str(path)])
    # the reference: each line read alone from a file of its own
    alone: tuple[list, list, list] = ([], [], [])
    for i, line in enumerate(raw.split(b"\n")):
        one = tmp_path / f"line{i}.jsonl"
        one.write_bytes(line + b"\n")
        texts, _, bad = _collect(list_inputs([str(one)])[0])
        alone[0].extend(texts)
        alone[1].extend([i] * len(texts))
        alone[2].extend((i, reason, excerpt) for _, reason, excerpt in bad)
    monkeypatch.setattr(sources, "READ_CHUNK", chunk)
    digest = FileDigest()
    fast = _collect(file, digest=digest, batch_docs=4)
    assert digest.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    assert fast == alone
    monkeypatch.setattr(sources, "_orjson_loads", None)
    assert _collect(file, batch_docs=4) == alone
    texts, records, bad = fast
    assert texts[0] == "after a BOM" and texts[-1] == "no newline at the end"
    assert records[-1] == len(lines) and (2, "blank_line") in [b[:2] for b in bad]


def test_nesting_deeper_than_the_fast_limit_takes_the_json_path(tmp_path, monkeypatch):
    """orjson's records are taken only up to FAST_MAX_DEPTH levels (json decides deeper
    ones); a text between brackets is not nesting."""
    import shardcache.builder.inputs.jsonl as sources

    pytest.importorskip("orjson")
    limit = sources.FAST_MAX_DEPTH
    deep = {"text": "deep", "m": []}
    for _ in range(limit - 2):
        deep["m"] = [deep["m"]]
    assert sources._nesting(deep, limit) == limit
    deeper = {"text": "deeper", "m": [deep]}
    assert sources._nesting(deeper, limit) == limit + 1
    lines = [json.dumps(r).encode() for r in (deep, deeper, {"text": "[" * 400 + "{" * 400})]
    path = tmp_path / "deep.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    (file,) = list_inputs([str(path)])
    parsed_by_json = []

    def loads(text):
        parsed_by_json.append(text)
        return json.loads(text)

    monkeypatch.setattr(sources, "json", SimpleNamespace(loads=loads))
    texts, records, bad = _collect(file)
    assert texts == ["deep", "deeper", "[" * 400 + "{" * 400] and records == [0, 1, 2] and not bad
    assert [json.loads(s)["text"] for s in parsed_by_json] == ["deeper"]


def test_a_folder_of_plain_text_says_text_is_read_by_name_or_glob(tmp_path):
    # before: "holds no input file (jsonl, ..., text)", listing text among what a folder is
    # read as, and never saying that a glob (-i 'DIR/**/*.txt') reads the same files
    folder = tmp_path / "notes"
    (folder / "sub").mkdir(parents=True)
    for name in ("a.txt", "b.txt", "sub/c.txt", "README.md"):
        (folder / name).write_text("some text\n")
    with pytest.raises(SourceError) as info:
        list_inputs([str(folder)])
    message = str(info.value)
    assert (
        "4 file(s) read only when named or matched by a glob (README.md, a.txt, b.txt and 1 "
        "more)" in message
    )
    assert f"-i '{folder}/**/*.txt'" in message and ", text" not in message.split("),")[0]
    globbed = list_inputs([f"{folder}/**/*.txt"])  # what the message says to give works
    assert sorted(f.relpath for f in globbed) == ["a.txt", "b.txt", "sub/c.txt"]
    empty = tmp_path / "empty"
    empty.mkdir()
    pattern = (
        r"holds no input file \(a folder's files are read as jsonl.*; text \(\.txt, .*\) "
        r"only when named or matched by a glob"
    )
    with pytest.raises(SourceError, match=pattern):
        list_inputs([str(empty)])
