from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest
from transformers import AutoTokenizer

import shardcache.builder.pool as pool_module
import shardcache.builder.run as build_module
from conftest import folder_files as _tree
from conftest import kill_env
from shardcache import BuildLockedError, CacheError, CacheNotFoundError, SourceError, open_cache
from shardcache.builder.run import build_cache as build
from shardcache.config import build_options_from_mapping


def _reference(tokenizer_dir: str, text: str) -> list[int]:
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    ids = tok(text)["input_ids"]
    eos = tok.eos_token_id if tok.eos_token_id is not None else tok.sep_token_id
    return ids if ids and ids[-1] == eos else [*ids, eos]


@pytest.mark.parametrize("fmt", ["jsonl", "jsonl.zst", "json.gz", "parquet"])
def test_every_document_exactly_once_with_tokenizer_ids(fmt, corpus, build_cache, tokenizer_dir):
    folder, expected = corpus(fmt, n_files=3, docs=30)
    cache = open_cache(build_cache(folder, tokenizer_dir, batch_docs=7))
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    seen = {}
    for seq in cache.iter_sequences():
        key = (seq.provenance.source, seq.provenance.record)
        assert key not in seen, f"{key} stored twice"
        seen[key] = seq.ids
    assert set(seen) == set(expected)
    for key, ids in seen.items():
        assert ids.tolist() == [*tok(expected[key])["input_ids"], tok.eos_token_id]
    assert cache.manifest["totals"]["documents"] == len(expected)


def test_wordpiece_ids_match_transformers_and_ignore_saved_truncation(
    corpus, build_cache, wordpiece_dir
):
    # tokenizer.json carries truncation max_length=16 and fixed padding: transformers'
    # tokenizer(text) ignores them, and so must the build (the key records them: issue 3).
    folder, expected = corpus("jsonl", n_files=1, docs=40)
    cache = open_cache(build_cache(folder, wordpiece_dir))
    lengths = []
    for seq in cache.iter_sequences():
        text = expected[(seq.provenance.source, seq.provenance.record)]
        assert seq.ids.tolist() == _reference(wordpiece_dir, text)  # [CLS] ... [SEP], no 2nd SEP
        lengths.append(len(seq.ids))
    assert max(lengths) > 16
    backend = cache.manifest["tokenizer"]["backend_truncation"]
    assert backend["max_length"] == 16


def test_no_add_special_tokens_then_sep_appended(corpus, build_cache, wordpiece_dir):
    folder, expected = corpus("jsonl", n_files=1, docs=10)
    cache = open_cache(build_cache(folder, wordpiece_dir, add_special_tokens=False))
    tok = AutoTokenizer.from_pretrained(wordpiece_dir)
    for seq in cache.iter_sequences():
        text = expected[(seq.provenance.source, seq.provenance.record)]
        plain = tok(text, add_special_tokens=False)["input_ids"]
        assert seq.ids.tolist() == [*plain, tok.sep_token_id]


def test_bos_from_post_processor_and_no_append_eos(corpus, build_cache, bos_tokenizer_dir):
    folder, expected = corpus("jsonl", n_files=1, docs=10)
    cache = open_cache(build_cache(folder, bos_tokenizer_dir, append_eos=False))
    tok = AutoTokenizer.from_pretrained(bos_tokenizer_dir)
    for seq in cache.iter_sequences():
        text = expected[(seq.provenance.source, seq.provenance.record)]
        assert seq.ids.tolist() == tok(text)["input_ids"]
        assert seq.ids[0] == tok.bos_token_id and seq.ids[-1] != tok.eos_token_id


def test_token_dtype_uint16_and_uint32(tmp_path, build_cache, tokenizer_dir, big_vocab_dir):
    from conftest import write_records

    path = write_records(str(tmp_path / "a.jsonl"), [{"text": "w1 w65529 <extra_9> w7"}], "jsonl")
    small = open_cache(build_cache(path, tokenizer_dir))
    assert small.dtype == np.uint16
    big = open_cache(build_cache(path, big_vocab_dir))
    assert big.manifest["tokenizer"]["max_token_id"] > 65535
    assert big.dtype == np.uint32
    ids = next(big.iter_sequences()).ids
    tok = AutoTokenizer.from_pretrained(big_vocab_dir)
    assert ids.tolist() == [*tok("w1 w65529 <extra_9> w7")["input_ids"], tok.eos_token_id]
    assert int(ids.max()) > 65535


@pytest.mark.parametrize("strategy", ["truncate", "drop", "split"])
def test_truncation_strategies_end_to_end(strategy, corpus, build_cache, tokenizer_dir):
    folder, expected = corpus("jsonl", n_files=1, docs=60)
    limit = 24
    cache = open_cache(build_cache(folder, tokenizer_dir, max_length=limit, truncation=strategy))
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    full = {k: [*tok(t)["input_ids"], tok.eos_token_id] for k, t in expected.items()}
    stored: dict[tuple[str, int], list[tuple[int, list[int]]]] = {}
    for seq in cache.iter_sequences():
        assert 1 <= len(seq.ids) <= limit
        key = (seq.provenance.source, seq.provenance.record)
        stored.setdefault(key, []).append((seq.provenance.piece, seq.ids.tolist()))
    long_docs = {k for k, ids in full.items() if len(ids) > limit}
    assert long_docs, "the corpus must contain documents longer than max_length"
    stats = cache.manifest["stats"]
    if strategy == "truncate":
        assert set(stored) == set(full)
        for key, [(piece, ids)] in stored.items():
            want = (
                full[key] if key not in long_docs else [*full[key][: limit - 1], tok.eos_token_id]
            )
            assert piece == 0 and ids == want
        assert stats["truncated_documents"] == len(long_docs)
        assert stats["lost_tokens"] == sum(len(full[k]) - limit for k in long_docs)
    elif strategy == "drop":
        assert set(stored) == set(full) - long_docs
        assert stats["dropped_documents"] == len(long_docs)
        assert stats["lost_tokens"] == sum(len(full[k]) for k in long_docs)
    else:
        assert set(stored) == set(full)
        for key, pieces in stored.items():
            pieces.sort()
            assert [p for p, _ in pieces] == list(range(len(pieces)))
            assert [t for _, ids in pieces for t in ids] == full[key]
        assert stats["split_documents"] == len(long_docs)
        assert stats["lost_tokens"] == 0


def test_buckets_hold_their_lengths(corpus, build_cache, tokenizer_dir):
    folder, _ = corpus("jsonl", n_files=2, docs=50)
    cache = open_cache(build_cache(folder, tokenizer_dir, buckets="4,16,64"))
    ranges = cache.manifest["buckets"]["ranges"]
    assert ranges == [[1, 4], [5, 16], [17, 64], [65, None]]
    buckets = cache.buckets()
    for seq in cache.iter_sequences():
        low, high = ranges[buckets[seq.sample_id]]
        assert low <= len(seq.ids) <= (high or 10**9)
    assert np.array_equal(cache.lengths, [len(s.ids) for s in cache.iter_sequences()])


def test_shards_rotate_at_target_size_and_compress(corpus, build_cache, tokenizer_dir):
    folder, expected = corpus("jsonl", n_files=1, docs=200)
    plain = open_cache(build_cache(folder, tokenizer_dir, shard_size=4096, buckets="1000"))
    assert len(plain.shards) >= 2
    # every shard but the last reached the target (token bytes), none is empty
    assert all(s["tokens"] * 2 >= 4096 for s in plain.shards[:-1])
    assert all(s["rows"] > 0 for s in plain.shards)
    packed = open_cache(
        build_cache(folder, tokenizer_dir, shard_size=4096, buckets="1000", compression="zstd")
    )
    a = [s.ids.tolist() for s in plain.iter_sequences()]
    b = [s.ids.tolist() for s in packed.iter_sequences()]
    assert a == b and len(a) == len(expected)


def test_interrupted_build_leaves_no_manifest(monkeypatch, corpus, tmp_path, tokenizer_dir):
    folder, _ = corpus("jsonl", n_files=2, docs=10)
    out = str(tmp_path / "out")
    options = build_options_from_mapping(
        {"input": folder, "tokenizer": tokenizer_dir, "output": out}
    )

    def crash(*args, **kwargs):
        raise KeyboardInterrupt("killed before commit")

    monkeypatch.setattr(build_module, "commit", crash)
    with pytest.raises(KeyboardInterrupt):
        build(options)
    assert os.listdir(os.path.join(out, "shards"))  # work was written...
    assert not os.path.exists(os.path.join(out, "manifest.json"))  # ...but never committed
    with pytest.raises(CacheNotFoundError, match="never committed"):
        open_cache(out)


def test_existing_cache_needs_force(corpus, build_cache, tokenizer_dir):
    import dataclasses

    folder, _ = corpus("jsonl", n_files=1, docs=5)
    out = build_cache(folder, tokenizer_dir)
    options = build_options_from_mapping(
        {"input": folder, "tokenizer": tokenizer_dir, "output": out}
    )
    assert build(options).up_to_date  # same options and inputs: nothing to do (issue 13)
    with pytest.raises(CacheError, match=r"max_length: None -> 8.*--force"):
        build(dataclasses.replace(options, tokenize=dataclasses.replace(
            options.tokenize, max_length=8)))  # fmt: skip
    build(dataclasses.replace(options, force=True))
    assert open_cache(out).num_sequences == 5


def test_a_build_that_kept_nothing_does_not_block_the_corrected_one(
    corpus, tokenizer_dir, tmp_path
):
    """Issue 51 item 6: a wrong --text-field fails with every record bad; the corrected command
    then builds without --force (nothing was kept), while kept work still needs it."""
    folder, _ = corpus("jsonl", n_files=2, docs=10)
    out = str(tmp_path / "out")
    values = {"input": folder, "tokenizer": tokenizer_dir, "output": out, "workers": 1}
    with pytest.raises(SourceError, match="kept no document"):
        build(build_options_from_mapping({**values, "text_field": "body"}))
    assert os.path.isfile(os.path.join(out, "parts", "build.json"))
    report = build(build_options_from_mapping(values))
    assert report.documents == 20 and report.resumed_partitions == 0
    assert open_cache(out).num_sequences == 20
    # an interrupted build that kept documents is still protected
    other = str(tmp_path / "other")
    options = build_options_from_mapping({**values, "output": other, "max_bad_fraction": 0.0})
    with open(os.path.join(folder, "part-01.jsonl"), "a", encoding="utf-8") as f:
        f.write('{"id": 99}\n')  # a bad record: more than max_bad_fraction 0
    with pytest.raises(SourceError, match="max-bad-fraction"):
        build(options)
    with pytest.raises(CacheError, match=r"interrupted build.*--force"):
        build(dataclasses.replace(options, tokenize=dataclasses.replace(
            options.tokenize, max_length=8)))  # fmt: skip


def test_no_tmp_files_or_pickles_left(corpus, build_cache, tokenizer_dir):
    folder, _ = corpus("jsonl", n_files=2, docs=20)
    out = build_cache(folder, tokenizer_dir)
    names = [f for _, _, files in os.walk(out) for f in files]
    assert not [n for n in names if n.endswith((".tmp", ".pkl", ".pickle"))]


# ------------------------------------------------------------------ parallel, resume, bad input

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def mixed_corpus(tmp_path_factory):
    """A big jsonl (split into byte ranges), a jsonl.zst (one partition), a parquet file with
    row groups (split into runs of them); returns (folder, texts by (relpath, record))."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from conftest import make_texts, write_records

    folder = tmp_path_factory.mktemp("mixed")
    texts = make_texts(160, seed=7)
    expected = {}
    write_records(str(folder / "a.jsonl"), [{"text": t} for t in texts], "jsonl")
    expected.update({("a.jsonl", i): t for i, t in enumerate(texts)})
    write_records(str(folder / "b.jsonl.zst"), [{"text": t} for t in texts[:40]], "jsonl.zst")
    expected.update({("b.jsonl.zst", i): t for i, t in enumerate(texts[:40])})
    table = pa.Table.from_pylist([{"text": t} for t in texts[:90]])
    pq.write_table(table, str(folder / "c.parquet"), row_group_size=15)
    expected.update({("c.parquet", i): t for i, t in enumerate(texts[:90])})
    return str(folder), expected


@pytest.fixture(scope="module")
def mixed_reference(mixed_corpus, tokenizer_dir, tmp_path_factory):
    """The uninterrupted in-process build of ``mixed_corpus``: (folder, tree)."""
    out = str(tmp_path_factory.mktemp("mixed-ref") / "cache")
    values = {"input": mixed_corpus[0], "tokenizer": tokenizer_dir, "output": out, "workers": 1}
    build(build_options_from_mapping({**values, **MIXED}))
    return out, _tree(out)


MIXED = {"partition_size": "2KiB", "shard_size": 4096, "buckets": "16,64", "batch_docs": 16}


def test_mixed_builds_use_the_fast_backend_when_installed(mixed_reference):
    """With shardcache[fast] installed, the default (auto) builds of this module -- 1/2/4
    workers, kill + resume -- run on the fast backend, so their byte-identity covers it."""
    pytest.importorskip("fastokens")
    manifest = open_cache(mixed_reference[0]).manifest
    assert set(manifest["encoder"]["partitions_by_backend"]) == {"fastokens"}
    assert manifest["encoder"]["documents_verified"] > 0


def test_identical_bytes_for_1_2_4_workers(
    mixed_corpus, mixed_reference, build_cache, tokenizer_dir
):
    folder, expected = mixed_corpus
    outs = [mixed_reference[0]] + [build_cache(folder, tokenizer_dir, workers=w, **MIXED)
                                   for w in (2, 4)]  # fmt: skip
    trees = [_tree(out) for out in outs]
    assert trees[0] == trees[1] == trees[2]
    cache = open_cache(outs[0])
    assert cache.manifest["partitions"] > 6  # a.jsonl and c.parquet were split
    # record indices stay file-global across byte-range / row-group partitions
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    seen = set()
    for seq in cache.iter_sequences():
        key = (seq.provenance.source, seq.provenance.record)
        assert key not in seen
        seen.add(key)
        assert seq.ids.tolist() == [*tok(expected[key])["input_ids"], tok.eos_token_id]
    assert seen == set(expected)
    import hashlib

    for entry in cache.manifest["inputs"]:  # the whole file's sha256, split or not
        with open(os.path.join(folder, entry["relpath"]), "rb") as f:
            assert entry["sha256"] == hashlib.sha256(f.read()).hexdigest()


def _run_killed(args: list[str], kill: str) -> subprocess.CompletedProcess:
    env = {**os.environ, **kill_env(kill)}
    cmd = [sys.executable, "-m", "shardcache.cli", "build", *args, "-q"]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    ("kill", "workers"),
    [("batch:3", 1), ("part:2", 1), ("commit:2", 1), ("part:1", 2)],
)
def test_sigkill_then_rerun_gives_identical_bytes(
    kill, workers, mixed_corpus, mixed_reference, tokenizer_dir, tmp_path
):
    folder, _ = mixed_corpus
    reference = mixed_reference[1]
    out = str(tmp_path / "killed")
    args = ["-i", folder, "-t", tokenizer_dir, "-o", out, "--workers", str(workers)]
    args += ["--partition-size", "2KiB", "--shard-size", "4096", "--buckets", "16,64"]
    args += ["--batch-docs", "16"]
    result = _run_killed(args, kill)
    assert result.returncode == -signal.SIGKILL, result.stderr
    assert not os.path.exists(os.path.join(out, "manifest.json"))
    assert os.path.exists(os.path.join(out, ".lock"))  # stale: its pid is dead
    report = build(
        build_options_from_mapping(
            {"input": folder, "tokenizer": tokenizer_dir, "output": out, "workers": 1, **MIXED}
        )
    )
    if kill.startswith(("part", "commit")):
        assert report.resumed_partitions >= 1
    assert _tree(out) == reference


@pytest.mark.parametrize("finish", ["build", "commit"])
def test_a_commit_killed_after_its_manifest_is_finished_by_the_next_run(
    finish, mixed_corpus, mixed_reference, tokenizer_dir, tmp_path
):
    """Killed between the manifest and removing the partition shards the merged ones
    replaced: the cache is readable, and rerunning the build (or `shardcache commit`) removes
    the leftovers instead of keeping a second copy of their rows forever."""
    from shardcache.builder.commit import commit_output

    folder, _ = mixed_corpus
    reference = mixed_reference[1]
    out = str(tmp_path / "killed")
    args = ["-i", folder, "-t", tokenizer_dir, "-o", out, "--workers", "1"]
    args += ["--partition-size", "2KiB", "--shard-size", "4096", "--buckets", "16,64"]
    args += ["--batch-docs", "16"]
    result = _run_killed(args, "committed:1")
    assert result.returncode == -signal.SIGKILL, result.stderr
    listed = {s["name"] for s in open_cache(out).manifest["shards"]}
    on_disk = set(os.listdir(os.path.join(out, "shards")))
    assert on_disk - listed  # the replaced shards, still there
    if finish == "build":
        values = {"input": folder, "tokenizer": tokenizer_dir, "output": out, "workers": 1}
        report = build(build_options_from_mapping({**values, **MIXED}))
    else:
        report = commit_output(out)
    assert report.up_to_date
    assert set(os.listdir(os.path.join(out, "shards"))) == listed
    assert _tree(out) == reference


def test_resume_refuses_other_options_and_force_starts_over(
    monkeypatch, corpus, tmp_path, tokenizer_dir
):
    import dataclasses

    folder, _ = corpus("jsonl", n_files=3, docs=10)
    out = str(tmp_path / "out")
    values = {"input": folder, "tokenizer": tokenizer_dir, "output": out, "workers": 1}
    monkeypatch.setattr(build_module, "commit", lambda *a: (_ for _ in ()).throw(OSError("x")))
    with pytest.raises(OSError):
        build(build_options_from_mapping(values))
    monkeypatch.undo()
    other = build_options_from_mapping({**values, "max_length": 8})
    with pytest.raises(CacheError, match=r"tokenize\.max_length: None -> 8.*--force"):
        build(other)
    report = build(dataclasses.replace(other, force=True))
    assert report.resumed_partitions == 0 and report.documents == 30


def test_bad_records_of_every_kind_counted_and_quarantined(tmp_path, build_cache, tokenizer_dir):
    import random

    from conftest import make_texts

    bad_lines = {
        "not_json": b'{"text": "unterminated',
        "not_an_object": b"[1, 2]",
        "invalid_utf8": b'{"text": "broken \xff\xfe bytes"}',
        "no_text_field": b'{"body": "no text"}',
        "text_not_string": b'{"text": 12345}',
        "empty_text": b'{"text": ""}',
        "blank_line": b"   ",
    }
    rng = random.Random(3)
    lines, valid, injected = [], {}, {}
    for i, text in enumerate(make_texts(200, seed=9)):
        if rng.random() < 0.25:
            reason = rng.choice(sorted(bad_lines))
            lines.append(bad_lines[reason])
            injected[len(lines) - 1] = reason
        lines.append(json.dumps({"text": f"{i} {text}"}).encode())
        valid[len(lines) - 1] = f"{i} {text}"
    path = tmp_path / "dirty.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    out = build_cache(
        str(path), tokenizer_dir, partition_size="2KiB", workers=2, max_bad_fraction=0.5
    )
    cache = open_cache(out)
    records = [s.provenance.record for s in cache.iter_sequences()]
    assert sorted(records) == sorted(valid)  # every valid record exactly once
    assert cache.manifest["stats"]["bad_records"] == dict(
        sorted(Counter(injected.values()).items())
    )
    with open(os.path.join(out, "quarantine.jsonl"), encoding="utf-8") as f:
        entries = [json.loads(line) for line in f]
    assert {e["record"]: e["reason"] for e in entries} == injected
    assert all(e["source"] == "dirty.jsonl" and "excerpt" in e for e in entries)
    from shardcache.store.summary import cache_summary, format_summary

    assert "not_json" in format_summary(cache_summary(cache))


@pytest.mark.parametrize("fmt", ["jsonl.zst", "json.gz"])
def test_corrupt_compressed_file_skip_keeps_the_rest_and_fail_names_it(
    fmt, tmp_path, build_cache, tokenizer_dir
):
    from conftest import write_records

    folder = tmp_path / "c"
    folder.mkdir()
    good = write_records(
        str(folder / "good.jsonl"), [{"text": f"ok {i}"} for i in range(30)], "jsonl"
    )
    data = [{"text": f"doc {i} " + "word " * (i % 50)} for i in range(8000)]
    broken = write_records(str(folder / f"broken.{fmt}"), data, fmt)
    with open(broken, "r+b") as f:
        size = os.path.getsize(broken)
        f.truncate(size // 2)
    out = build_cache(str(folder), tokenizer_dir, workers=1)
    cache = open_cache(out)
    stats = cache.manifest["stats"]
    assert stats["bad_records"] == {"corrupt_file": 1}
    [lost] = stats["corrupt_files"]
    assert lost["source"] == f"broken.{fmt}" and lost["offset"] > 0
    by_source = Counter(s.provenance.source for s in cache.iter_sequences())
    assert by_source["good.jsonl"] == 30
    kept = sorted(
        s.provenance.record
        for s in cache.iter_sequences()
        if s.provenance.source == f"broken.{fmt}"
    )
    assert kept == list(range(len(kept))) and 0 < len(kept) < 8000  # a clean prefix
    assert lost["record"] == len(kept)
    with open(os.path.join(out, "quarantine.jsonl"), encoding="utf-8") as f:
        assert json.loads(f.read().splitlines()[-1])["reason"] == "corrupt_file"
    options = build_options_from_mapping(
        {
            "input": str(folder),
            "tokenizer": tokenizer_dir,
            "output": str(tmp_path / "f"),
            "on_error": "fail",
            "workers": 1,
        }
    )
    with pytest.raises(SourceError, match=rf"broken\.{fmt.replace('.', '[.]')}: .*offset"):
        build(options)
    assert good


def test_a_second_build_into_a_locked_output_is_refused(corpus, tmp_path, tokenizer_dir):
    import socket
    import time

    folder, _ = corpus("jsonl", n_files=1, docs=5)
    out = tmp_path / "out"
    out.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        lock = {"pid": holder.pid, "host": socket.gethostname(), "started": time.time()}
        (out / ".lock").write_text(json.dumps(lock))
        options = build_options_from_mapping(
            {"input": folder, "tokenizer": tokenizer_dir, "output": str(out), "workers": 1}
        )
        with pytest.raises(BuildLockedError, match=rf"pid {holder.pid} on this host"):
            build(dataclasses.replace(options, force=True))  # --force never breaks a live lock
        assert not os.path.exists(out / "manifest.json")
    finally:
        holder.kill()
        holder.wait()
    build(options)  # the holder is dead now: its lock is stale and taken over
    assert open_cache(str(out)).num_sequences == 5
    assert not os.path.exists(out / ".lock")


def test_two_concurrent_builds_one_is_refused(monkeypatch, corpus, tmp_path, tokenizer_dir):
    import threading

    folder, _ = corpus("jsonl", n_files=2, docs=20)
    out = str(tmp_path / "out")
    options = build_options_from_mapping(
        {"input": folder, "tokenizer": tokenizer_dir, "output": out, "workers": 1}
    )
    started, release = threading.Event(), threading.Event()
    real = pool_module.build_partition

    def slow_partition(*args, **kwargs):
        started.set()
        release.wait(30)
        return real(*args, **kwargs)

    monkeypatch.setattr(pool_module, "build_partition", slow_partition)
    first = threading.Thread(target=build, args=(options,))
    first.start()
    try:
        assert started.wait(30)
        with pytest.raises(BuildLockedError, match="being built by another process"):
            build(options)
    finally:
        release.set()
        first.join(60)
    assert open_cache(out).num_sequences == 40


def test_a_build_sweeps_what_killed_builds_commits_and_verifies_left(
    corpus, tmp_path, tokenizer_dir, monkeypatch
):
    """A kill -9 leaves scratch behind: a URL partition's or commit's staging folder, a pool's
    payload file (temporary folder), a remote verify's copy of a cache (cache folder). The
    next build removes those whose pid is dead, and keeps live and unrelated ones."""
    import tempfile

    from shardcache.store.files import cache_root

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    dead = [scratch / f"shardcache-part-{gone.pid}-p00003-x1",
            scratch / f"shardcache-commit-{gone.pid}-x2",
            scratch / f"shardcache-pool-{gone.pid}-x3.pickle", tmp_path / "cache-dir"]  # fmt: skip
    monkeypatch.setenv("SHARDCACHE_CACHE_DIR", str(dead[-1]))
    dead[-1] = dead[-1] / f"verify-{gone.pid}-x4"
    kept = [scratch / f"shardcache-part-{os.getpid()}-p00001-y", scratch / "shardcache-p00002-old",
            scratch / "unrelated", dead[-1].parent / "tokenizers"]  # fmt: skip
    for path in dead + kept:
        if path.name.endswith(".pickle"):
            path.write_bytes(b"x")
        else:
            (path / "shards").mkdir(parents=True)
    assert cache_root() == str(dead[-1].parent)
    folder, _ = corpus("jsonl", n_files=1, docs=5)
    build(build_options_from_mapping({"input": folder, "tokenizer": tokenizer_dir,
                                      "output": str(tmp_path / "out"), "workers": 1}))  # fmt: skip
    assert [p for p in dead if p.exists()] == []
    assert all(p.exists() for p in kept)
