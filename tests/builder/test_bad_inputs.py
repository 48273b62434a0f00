"""Issue 13 ("Trust II"): every bad input gets a clear answer; no hang, crash or silent empty
cache. Each test drives the real build (real tokenizer, real files) and checks the message."""

from __future__ import annotations

import json
import os

import pytest
from click.testing import CliRunner

from conftest import kill_env, make_texts, write_records
from shardcache import SourceError, open_cache
from shardcache.cli import main


def _records(n: int, field: str = "text", seed: int = 0) -> list[dict]:
    return [{field: t, "id": i} for i, t in enumerate(make_texts(n, seed=seed))]


# --- 1. empty or mostly-bad builds fail ------------------------------------------------------


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_a_build_that_keeps_no_document_fails_and_names_the_field(
    fmt, tmp_path, build_cache, tokenizer_dir
):
    path = write_records(str(tmp_path / f"d.{fmt}"), _records(20), fmt)
    with pytest.raises(SourceError) as info:
        build_cache(path, tokenizer_dir, text_field="body")
    message = str(info.value)
    assert "no record has field 'body'" in message
    assert "text" in message and "id" in message
    assert "did you mean --text-field text?" in message
    out = str(tmp_path / "cache-0")
    assert not os.path.exists(os.path.join(out, "manifest.json"))


def test_chat_data_built_as_text_suggests_chat(tmp_path, build_cache, tokenizer_dir):
    records = [{"messages": [{"role": "user", "content": "hi"}]} for _ in range(5)]
    path = write_records(str(tmp_path / "c.jsonl"), records, "jsonl")
    with pytest.raises(SourceError, match=r"--chat"):
        build_cache(path, tokenizer_dir)


def test_more_bad_than_max_bad_fraction_fails_unless_allowed(tmp_path, tokenizer_dir):
    lines = [json.dumps(r) for r in _records(16)] + ["not json"] * 4  # 20% bad
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(lines) + "\n")
    out = str(tmp_path / "out")
    args = ["build", "-i", str(path), "-t", tokenizer_dir, "-o", out, "-q", "-w", "1"]
    runner = CliRunner()
    result = runner.invoke(main, args)
    assert result.exit_code == 1, result.output
    assert "4 of 20 records" in result.output and "--max-bad-fraction" in result.output
    assert "not_json: 4" in result.output
    assert not os.path.exists(os.path.join(out, "manifest.json"))
    # allowing it commits the partitions already built (the flag is not part of the key)
    result = runner.invoke(main, [*args, "--max-bad-fraction", "0.25"])
    assert result.exit_code == 0, result.output
    assert open_cache(out).manifest["totals"]["documents"] == 16
    bad = runner.invoke(main, [*args, "--max-bad-fraction", "1.5"])
    assert bad.exit_code == 2 and "max-bad-fraction" in bad.output


# --- 5. one bad record never kills a build ----------------------------------------------------


def _dirty_file(tmp_path, bad_lines: list[str], n_good: int = 40) -> tuple[str, dict[int, str]]:
    """A jsonl file of good records with ``bad_lines`` spread in; returns (path, line -> bad)."""
    lines = [json.dumps(r) for r in _records(n_good)]
    where = {}
    for k, bad in enumerate(bad_lines):
        index = 3 + k * 5
        lines.insert(index, bad)
        where[index] = bad
    path = tmp_path / "dirty.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(path), where


DEEP = '{"text": ' + "[" * 100_000 + "]" * 100_000 + "}"


def test_lone_surrogate_and_deep_nesting_are_quarantined_with_file_and_line(
    tmp_path, build_cache, tokenizer_dir
):
    path, _ = _dirty_file(tmp_path, ['{"text": "x\\ud800y"}', DEEP, '{"text": "a\\udfffb"}'])
    out = build_cache(path, tokenizer_dir, max_bad_fraction=0.5)
    cache = open_cache(out)
    assert cache.manifest["totals"]["documents"] == 40
    with open(os.path.join(out, "quarantine.jsonl"), encoding="utf-8") as f:
        entries = [json.loads(line) for line in f]
    got = {e["record"]: (e["reason"], e["line"], e["source"]) for e in entries}
    assert got == {
        3: ("invalid_unicode", 4, "dirty.jsonl"),
        8: ("too_deep", 9, "dirty.jsonl"),
        13: ("invalid_unicode", 14, "dirty.jsonl"),
    }


def test_lone_surrogate_with_on_error_fail_names_file_and_line(
    tmp_path, build_cache, tokenizer_dir
):
    path, _ = _dirty_file(tmp_path, ['{"text": "x\\ud800y"}'])
    with pytest.raises(SourceError, match=r"dirty\.jsonl: line 4 .*invalid_unicode"):
        build_cache(path, tokenizer_dir, on_error="fail")


def test_lone_surrogate_in_a_conversation_is_quarantined(
    tmp_path, build_cache, chatml_tokenizer_dir
):
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    good = [{"messages": turns} for _ in range(20)]
    lines = [json.dumps(r) for r in good]
    lines.insert(2, '{"messages": [{"role": "user", "content": "x\\ud800"}]}')
    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join(lines) + "\n")
    out = build_cache(str(path), chatml_tokenizer_dir, chat=True)
    with open(os.path.join(out, "quarantine.jsonl"), encoding="utf-8") as f:
        [entry] = [json.loads(line) for line in f]
    assert entry["reason"] == "invalid_unicode" and entry["line"] == 3


def test_a_record_the_tokenizer_rejects_is_quarantined_not_fatal(
    tmp_path, build_cache, tokenizer_dir, monkeypatch
):
    # Whatever makes the backend fail on one text (a tokenizer bug, an allocator limit) is
    # that record's: the batch is retried text by text and only the failing one is quarantined.
    from shardcache.builder.tokenize import TextEncoder

    real = TextEncoder.encode_texts

    def picky(self, texts, records=None):
        if any("POISON" in t for t in texts) and len(texts) > 1:
            raise RuntimeError("backend failure on a batch")
        if any("POISON" in t for t in texts):
            raise RuntimeError("backend failure")
        return real(self, texts, records)

    monkeypatch.setattr(TextEncoder, "encode_texts", picky)
    path, _ = _dirty_file(tmp_path, ['{"text": "a POISON text"}'])
    out = build_cache(path, tokenizer_dir)
    assert open_cache(out).manifest["stats"]["bad_records"] == {"encode_error": 1}


# --- 2. an output folder inside an input folder ----------------------------------------------


def test_output_inside_the_input_folder_is_not_an_input(tmp_path, tokenizer_dir):
    data = tmp_path / "data"
    data.mkdir()
    write_records(str(data / "a.jsonl"), _records(30), "jsonl")
    (data / "b.jsonl").write_text('{"text": "a"}\n\n{"text": "b"}\n')  # a quarantined line
    out = str(data / "cache")
    args = ["build", "-i", str(data), "-t", tokenizer_dir, "-o", out, "-q", "-w", "1"]
    runner = CliRunner()
    assert runner.invoke(main, args).exit_code == 0
    assert os.path.exists(os.path.join(out, "quarantine.jsonl"))
    result = runner.invoke(main, [*args, "--force"])
    assert result.exit_code == 0, result.output
    manifest = open_cache(out).manifest
    assert [f["relpath"] for f in manifest["inputs"]] == ["a.jsonl", "b.jsonl"]
    assert manifest["totals"]["documents"] == 32
    # another cache (or an interrupted build) inside the corpus is not read either
    other = str(data / "old-cache")
    assert runner.invoke(main, ["build", "-i", str(data / "a.jsonl"), "-t", tokenizer_dir,
                                "-o", other, "-q", "-w", "1"]).exit_code == 0  # fmt: skip
    from shardcache.builder.sources import list_inputs

    assert [f.relpath for f in list_inputs([str(data)])] == ["a.jsonl", "b.jsonl"]


# --- 6. FIFOs, devices, sockets -------------------------------------------------------------


def test_a_fifo_among_the_inputs_is_refused_at_listing(tmp_path):
    from shardcache.builder.sources import list_inputs

    write_records(str(tmp_path / "a.jsonl"), _records(3), "jsonl")
    os.mkfifo(tmp_path / "pipe.jsonl")
    with pytest.raises(SourceError, match=r"pipe\.jsonl.*not a regular file"):
        list_inputs([str(tmp_path)])
    with pytest.raises(SourceError, match=r"pipe\.jsonl.*not a regular file"):
        list_inputs([str(tmp_path / "pipe.jsonl")])
    os.symlink("/dev/zero", tmp_path / "zero.jsonl")
    os.remove(tmp_path / "pipe.jsonl")
    with pytest.raises(SourceError, match=r"zero\.jsonl.*not a regular file"):
        list_inputs([str(tmp_path / "*.jsonl")])


# --- 12. symlinked inputs (a Hugging Face hub snapshot) -------------------------------------


def test_symlinked_inputs_take_format_and_provenance_from_the_link(
    tmp_path, build_cache, tokenizer_dir
):
    blobs, snap = tmp_path / "blobs", tmp_path / "snap"
    blobs.mkdir()
    snap.mkdir()
    write_records(str(blobs / "9f3a1c"), _records(12), "jsonl")
    write_records(str(blobs / "77b0e2"), _records(5, seed=1), "json.gz")
    os.symlink("../blobs/9f3a1c", snap / "train.jsonl")
    os.symlink("../blobs/77b0e2", snap / "valid.json.gz")
    from shardcache.builder.sources import list_inputs

    files = list_inputs([str(snap)])
    assert [(f.relpath, f.format) for f in files] == [
        ("train.jsonl", "jsonl"),
        ("valid.json.gz", "json.gz"),
    ]
    cache = open_cache(build_cache(str(snap / "train.jsonl"), tokenizer_dir))
    assert {s.provenance.source for s in cache.iter_sequences()} == {"train.jsonl"}
    # the same file reached through a link and directly is listed once
    assert len(list_inputs([str(snap / "train.jsonl"), str(snap)])) == 2


def test_a_symlink_loop_is_a_clear_error(tmp_path):
    from shardcache.builder.sources import list_inputs

    os.symlink("b.jsonl", tmp_path / "a.jsonl")
    os.symlink("a.jsonl", tmp_path / "b.jsonl")
    with pytest.raises(SourceError, match=r"a\.jsonl.*(loop|links)"):
        list_inputs([str(tmp_path / "a.jsonl")])
    with pytest.raises(SourceError, match=r"\.jsonl.*(loop|links)"):
        list_inputs([str(tmp_path)])


# --- 16. an idempotent rerun ----------------------------------------------------------------


def test_rerunning_a_committed_build_is_up_to_date_and_a_change_is_named(tmp_path, tokenizer_dir):
    path = write_records(str(tmp_path / "a.jsonl"), _records(10), "jsonl")
    out = str(tmp_path / "out")
    args = ["build", "-i", path, "-t", tokenizer_dir, "-o", out, "-q", "-w", "1"]
    runner = CliRunner()
    assert runner.invoke(main, args).exit_code == 0
    before = os.stat(os.path.join(out, "manifest.json")).st_mtime_ns
    again = runner.invoke(main, args)
    assert again.exit_code == 0, again.output
    assert "up to date" in again.output and "tokens/s" not in again.output
    assert os.stat(os.path.join(out, "manifest.json")).st_mtime_ns == before
    as_json = runner.invoke(main, [*args, "--json"])
    assert json.loads(as_json.output)["up_to_date"] is True
    other = runner.invoke(main, [*args, "--max-length", "8"])
    assert other.exit_code == 1
    assert "tokenize.max_length: None -> 8" in other.output and "--force" in other.output
    with open(path, "a") as f:
        f.write('{"text": "one more"}\n')
    changed = runner.invoke(main, args)
    assert changed.exit_code == 1 and "input a.jsonl: changed" in changed.output
    # `commit` on a committed cache reports it as up to date, not at an absurd speed
    committed = runner.invoke(main, ["commit", out])
    assert committed.exit_code == 0 and "up to date" in committed.output
    assert "tokens/s" not in committed.output


# --- 3, 4. JSON array files, BOM, CR-only line endings --------------------------------------


def _texts_of(file, **kw) -> tuple[list[str], list[tuple[int, str]]]:
    from shardcache.builder.sources import iter_text_batches

    bad: list[tuple[int, str]] = []
    texts: list[str] = []
    for batch in iter_text_batches(file, on_bad=lambda i, r, e: bad.append((i, r)), **kw):
        texts += batch.texts
    return texts, bad


@pytest.mark.parametrize("name", ["export.json", "export.json.gz"])
@pytest.mark.parametrize("indent", [None, 2])
def test_a_json_array_file_is_read_as_records(tmp_path, name, indent):
    import gzip

    from shardcache.builder.sources import list_inputs

    records = [
        {"text": f'doc {i} with "quotes", [brackets] {{braces}} \\ and 東京'} for i in range(50)
    ]
    records.insert(7, {"body": "no text"})
    data = json.dumps(records, indent=indent, ensure_ascii=False).encode()
    path = tmp_path / name
    path.write_bytes(gzip.compress(data) if name.endswith(".gz") else data)
    [file] = list_inputs([str(tmp_path)])
    texts, bad = _texts_of(file, batch_docs=8)
    assert texts == [r["text"] for r in records if "text" in r]
    assert bad == [(7, "no_text_field")]
    with pytest.raises(SourceError, match=rf"{name}: item 8 is invalid \(no_text_field\)"):
        _texts_of(file, on_error="fail")


def test_quarantine_of_a_json_array_file_names_items(tmp_path, build_cache, tokenizer_dir):
    records = [{"text": f"doc {i}"} for i in range(30)]
    records[3] = {"body": "x"}
    path = tmp_path / "export.json"
    path.write_text(json.dumps(records))
    out = build_cache(str(path), tokenizer_dir)
    with open(os.path.join(out, "quarantine.jsonl"), encoding="utf-8") as f:
        [entry] = [json.loads(line) for line in f]
    assert entry["record"] == 3 and entry["item"] == 4 and "line" not in entry


def test_json_array_is_streamed_with_bounded_memory(tmp_path, monkeypatch):
    import shardcache.builder.inputs.jsonl as jsonl
    import shardcache.builder.sources as sources

    path = tmp_path / "big.json"
    n = 3000
    path.write_text(json.dumps([{"text": f"doc {i} " + "x" * 500} for i in range(n)]))
    reads: list[int] = []
    real = jsonl.array_items

    def spy(stream):
        for item in real(stream):
            reads.append(len(item))
            yield item

    monkeypatch.setattr(jsonl, "array_items", spy)
    [file] = sources.list_inputs([str(path)])
    texts, bad = _texts_of(file, batch_docs=64)
    assert len(texts) == n and not bad and max(reads) < 600


def test_jsonl_still_reads_when_it_starts_with_an_array_line(tmp_path):
    from shardcache.builder.sources import list_inputs

    path = tmp_path / "x.jsonl"
    path.write_text('[1, 2]\n{"text": "a"}\n')
    [file] = list_inputs([str(path)])
    assert _texts_of(file) == (["a"], [(0, "not_an_object")])


def test_a_utf8_bom_does_not_cost_the_first_record(tmp_path):
    from shardcache.builder.sources import list_inputs

    path = tmp_path / "bom.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"text": "first"}\n{"text": "second"}\n')
    [file] = list_inputs([str(path)])
    assert _texts_of(file) == (["first", "second"], [])
    path = tmp_path / "bom.json"
    path.write_bytes(b'\xef\xbb\xbf[{"text": "first"}, {"text": "second"}]')
    [file] = list_inputs([str(path)])
    assert _texts_of(file) == (["first", "second"], [])


@pytest.mark.parametrize("fmt", ["jsonl", "json.gz"])
def test_cr_only_line_endings_are_lines(tmp_path, fmt):
    import gzip

    from shardcache.builder.sources import list_inputs

    data = b'{"text": "one"}\r{"text": "two"}\r\r{"text": "three"}\r'
    path = tmp_path / f"mac.{fmt}"
    path.write_bytes(gzip.compress(data) if fmt == "json.gz" else data)
    [file] = list_inputs([str(path)])
    assert _texts_of(file) == (["one", "two", "three"], [(2, "blank_line")])


# --- 17. 1-based line numbers wherever a person reads them ----------------------------------


def test_people_read_1_based_lines(tmp_path, build_cache, tokenizer_dir):
    from shardcache.builder.report import format_report, report_from_manifest

    data = [{"text": f"doc {i} " + "word " * (i % 50)} for i in range(8000)]
    broken = write_records(str(tmp_path / "broken.json.gz"), data, "json.gz")
    with open(broken, "r+b") as f:
        f.truncate(os.path.getsize(broken) // 2)
    out = build_cache(broken, tokenizer_dir)
    cache = open_cache(out)
    [lost] = cache.manifest["stats"]["corrupt_files"]
    assert lost["line"] == lost["record"] + 1
    text = format_report(report_from_manifest(out, cache.manifest, 1.0))
    assert f"from line {lost['record'] + 1} " in text
    first = next(iter(cache.iter_sequences()))
    assert first.provenance.line == first.provenance.record + 1


# --- 8. Ctrl-C ------------------------------------------------------------------------------


def _tree(folder: str) -> dict[str, bytes]:
    out = {}
    for root, _, files in os.walk(folder):
        for name in files:
            rel = os.path.relpath(os.path.join(root, name), folder)
            if not rel.startswith(("parts", ".lock")):
                with open(os.path.join(root, name), "rb") as f:
                    out[rel] = f.read()
    return out


def _sigint_default() -> None:  # a child of a shell that ignores SIGINT would inherit that
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _cli(args: list[str], env: dict[str, str] | None = None, **kw):
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": repo, **(env or {})}
    cmd = [sys.executable, "-m", "shardcache.cli", *args]
    return subprocess.run(
        cmd, env=env, capture_output=True, text=True, preexec_fn=_sigint_default, timeout=120, **kw
    )  # fmt: skip  (timeout: a hang guard)


@pytest.mark.parametrize("workers", [1, 2])
def test_ctrl_c_stops_the_build_and_a_rerun_resumes_to_the_same_bytes(
    workers, tmp_path, tokenizer_dir
):
    folder = tmp_path / "data"
    folder.mkdir()
    for f in range(3):
        write_records(str(folder / f"{f}.jsonl"), _records(150, seed=f), "jsonl")
    args = ["build", "-i", str(folder), "-t", tokenizer_dir, "--partition-size", "2KiB",
            "--batch-docs", "8", "--shard-size", "4096", "-q", "-w", str(workers)]  # fmt: skip
    reference = str(tmp_path / "reference")
    assert _cli([*args, "-o", reference]).returncode == 0
    out = str(tmp_path / "out")
    # the test hook sends SIGINT (to the build process) at the 3rd encode batch
    result = _cli([*args, "-o", out], env=kill_env("batch:3:INT"))
    assert result.returncode == 130, result.stderr
    assert "interrupted" in result.stderr and "rerun" in result.stderr
    assert "Traceback" not in result.stderr
    assert not os.path.exists(os.path.join(out, "manifest.json"))
    assert _cli([*args, "-o", out]).returncode == 0
    assert _tree(out) == _tree(reference)


def test_a_second_ctrl_c_exits_at_once():
    import subprocess
    import sys

    script = (
        "import os, signal, time\n"
        "from shardcache.cli import interruptible\n"
        "with interruptible('cleanup'):\n"
        "    try:\n"
        "        os.kill(os.getpid(), signal.SIGINT); time.sleep(5)\n"
        "    except KeyboardInterrupt:\n"
        "        os.kill(os.getpid(), signal.SIGINT); time.sleep(5)\n"  # slow cleanup
        "        print('cleanup finished')\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            preexec_fn=_sigint_default, timeout=60)  # fmt: skip
    assert result.returncode == 130 and "cleanup finished" not in result.stdout


# --- 9. workers that cannot start -----------------------------------------------------------


def _build_from_stdin(tmp_path, tokenizer_dir, workers: int, files: int, after: str = ""):
    """Run ``build_cache(workers=...)`` over ``files`` small jsonl files as a script read
    from stdin (``python -``), then ``after``; a timeout only guards against a hang."""
    import subprocess
    import sys

    for f in range(files):
        write_records(str(tmp_path / f"{f}.jsonl"), _records(20, seed=f), "jsonl")
    script = (
        "import multiprocessing\n"
        "from shardcache.builder.run import build_cache\n"
        "from shardcache.config import build_options_from_mapping\n"
        f"values = {{'input': {str(tmp_path)!r}, 'tokenizer': {tokenizer_dir!r}, "
        f"'output': {str(tmp_path / 'out')!r}, 'workers': {workers}}}\n"
        "report = build_cache(build_options_from_mapping(values))\n"
    ) + after
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return subprocess.run(
        [sys.executable, "-"],
        input=script,
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": repo},
        timeout=120,
    )


def test_a_script_on_stdin_with_workers_fails_fast_with_the_guard_advice(tmp_path, tokenizer_dir):
    result = _build_from_stdin(tmp_path, tokenizer_dir, workers=3, files=2)
    assert result.returncode == 1
    assert "if __name__ == '__main__':" in result.stderr
    assert "ShardcacheError" in result.stderr


def test_two_workers_on_the_fast_backend_need_no_worker_processes(tmp_path, tokenizer_dir):
    # up to two workers, a fast-backend text build runs its partitions in threads of this
    # process: a script on stdin (which spawned workers cannot re-import) builds
    pytest.importorskip("fastokens")
    after = (
        "print(report.workers, report.partitions, *report.encoder['partitions_by_backend'],\n"
        "      len(multiprocessing.active_children()))\n"
    )
    result = _build_from_stdin(tmp_path, tokenizer_dir, workers=2, files=3, after=after)
    assert result.returncode == 0, result.stderr[-3000:]
    workers, partitions, encoder, children = result.stdout.split()
    assert (workers, partitions, children) == ("2", "3", "0")
    assert encoder == "fastokens"


# --- 11. disk errors ------------------------------------------------------------------------


def _small_file_limit() -> None:
    import resource
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, resource.RLIM_INFINITY))


def test_a_file_size_limit_is_a_clear_error_and_the_build_resumes(tmp_path, tokenizer_dir):
    import subprocess
    import sys

    path = write_records(str(tmp_path / "a.jsonl"), _records(3000), "jsonl")
    out = str(tmp_path / "out")
    args = ["build", "-i", path, "-t", tokenizer_dir, "-o", out, "-q", "-w", "1",
            "--shard-size", "1MiB", "--buckets", "4096"]  # fmt: skip
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": repo}
    cmd = [sys.executable, "-m", "shardcache.cli", *args]
    limited = subprocess.run(cmd, env=env, capture_output=True, text=True,
                             preexec_fn=_small_file_limit, timeout=120)  # fmt: skip
    assert limited.returncode == 1, limited.stderr
    assert "Traceback" not in limited.stderr
    assert "file-size limit" in limited.stderr and "shards" in limited.stderr
    assert "rerun" in limited.stderr
    assert _cli(args).returncode == 0
    assert open_cache(out).manifest["totals"]["documents"] == 3000


# --- 7. chat template render budget ---------------------------------------------------------

HUGE_LOOP = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
HUGE_OUTPUT = "{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}"
BUDGET_TEMPLATE = (
    "{% for m in messages %}{% if m['content'] == 'loop' %}" + HUGE_LOOP + "{% endif %}"
    "{% if m['content'] == 'big' %}" + HUGE_OUTPUT + "{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
)


def test_a_template_over_its_render_budget_quarantines_the_conversation(
    tmp_path, build_cache, chatml_tokenizer_dir
):
    template = tmp_path / "t.jinja"
    template.write_text(BUDGET_TEMPLATE)
    convs = [[{"role": "user", "content": f"hi {i}"}, {"role": "assistant", "content": "yo"}]
             for i in range(30)]  # fmt: skip
    convs[4][0]["content"] = "loop"
    convs[9][0]["content"] = "big"
    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in convs))
    out = build_cache(str(path), chatml_tokenizer_dir, chat=True, chat_template=str(template))
    cache = open_cache(out)
    assert cache.manifest["stats"]["bad_records"] == {"template_budget": 2}
    with open(os.path.join(out, "quarantine.jsonl"), encoding="utf-8") as f:
        entries = [json.loads(line) for line in f]
    assert [(e["line"], e["reason"]) for e in entries] == [(5, "template_budget"),
                                                          (10, "template_budget")]  # fmt: skip
    assert cache.manifest["totals"]["documents"] == 28


def test_lock_with_a_runaway_template_fails_cleanly(tmp_path, chatml_tokenizer_dir):
    template = tmp_path / "t.jinja"
    template.write_text(HUGE_LOOP + "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    args = ["lock", "-t", chatml_tokenizer_dir, "--chat", "--chat-template", str(template),
            "--no-data", "-o", str(tmp_path / "x.lock")]  # fmt: skip
    result = _cli(args)
    assert result.returncode == 1, result.stderr
    assert "render budget" in result.stderr and "Traceback" not in result.stderr


# --- 9b. workers that cannot start, with a real-size tokenizer ------------------------------


def _run_build_script(tmp_path, tokenizer: str, how: str):
    """Run a build_cache(workers=3) script as ``python -`` (how="stdin") or as a script file
    without the ``__main__`` guard (how="file"); a timeout only guards against a hang."""
    import subprocess
    import sys

    for f in range(2):
        write_records(str(tmp_path / f"{f}.jsonl"), _records(20, seed=f), "jsonl")
    script = (
        "from shardcache.builder.run import build_cache\n"
        "from shardcache.config import build_options_from_mapping\n"
        f"values = {{'input': {str(tmp_path)!r}, 'tokenizer': {tokenizer!r}, "
        f"'output': {str(tmp_path / 'out')!r}, 'workers': 3}}\n"
        "build_cache(build_options_from_mapping(values))\n"
    )
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    args: list[str] = [sys.executable, "-"]
    if how == "file":
        (tmp_path / "unguarded.py").write_text(script)
        args = [sys.executable, str(tmp_path / "unguarded.py")]
    return subprocess.run(
        args,
        input=script if how == "stdin" else None,
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": repo},
        timeout=120,
    )


def test_a_script_on_stdin_with_a_large_tokenizer_fails_fast_instead_of_hanging(
    tmp_path, large_bpe_dir
):
    # the spawn payload (encoder spec + plan) used to exceed the pipe buffer of a child that
    # had died re-importing '<stdin>': the parent blocked writing it, forever
    result = _run_build_script(tmp_path, large_bpe_dir, "stdin")
    assert result.returncode == 1, result.stderr[-3000:]
    assert "if __name__ == '__main__':" in result.stderr
    assert "<stdin>" in result.stderr
    assert "FileNotFoundError" not in result.stderr  # refused before any worker started


def test_an_unguarded_script_with_a_large_tokenizer_fails_instead_of_hanging(
    tmp_path, large_bpe_dir
):
    result = _run_build_script(tmp_path, large_bpe_dir, "file")
    assert result.returncode == 1, result.stderr[-3000:]
    assert "if __name__ == '__main__':" in result.stderr
