"""The build plan (shardcache/builder/build_plan.py): small files gathered into partitions.

Consecutive small files share a partition (:func:`group_bytes`): the plan of many tiny
files has far fewer partitions than files (about ``GROUP_SPREAD``), keeps their sorted order,
and the cache holds the same ids in the same order as one built from the same records in one
file, with each row's provenance, each file's hash and counts, and the quarantine's file/line
positions those of its own file; bytes do not depend on the workers or on a kill and a rerun.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys

import pytest

from conftest import folder_files, kill_env, make_texts
from shardcache import open_cache
from shardcache.builder.build_plan import (
    GROUP_SPREAD,
    group_bytes,
    plan_build,
    plan_from_json,
    plan_to_json,
)
from shardcache.builder.run import build_cache
from shardcache.builder.sources import list_inputs
from shardcache.config import build_options_from_mapping

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _tiny_files(folder, n: int, bad: dict[int, str] | None = None) -> list[str]:
    """``n`` one-record jsonl files (``bad[k]``: a second, bad line in file k); the texts."""
    folder.mkdir()
    texts = make_texts(n, seed=3, max_words=12)
    for k, text in enumerate(texts):
        lines = [json.dumps({"text": text})]
        if bad and k in bad:
            lines.append(bad[k])
        (folder / f"f{k:04d}.jsonl").write_text("\n".join(lines) + "\n")
    return texts


def _options(folder, out, tokenizer_dir, **more):
    values = {"input": str(folder), "tokenizer": tokenizer_dir, "output": str(out),
              "workers": 1, **more}  # fmt: skip
    return build_options_from_mapping(values)


def _built(folder, out, tokenizer_dir, **more):
    build_cache(_options(folder, out, tokenizer_dir, **more))
    return open_cache(str(out))


def test_the_plan_of_500_tiny_files_groups_them_in_order(tmp_path, tokenizer_dir):
    _tiny_files(tmp_path / "tiny", 500)
    options = _options(tmp_path / "tiny", tmp_path / "out", tokenizer_dir)
    inputs = list_inputs(options.source.inputs)
    most = group_bytes(inputs, options.partition_size_bytes)
    assert most == sum(f.size for f in inputs) // GROUP_SPREAD  # far under 256 MiB / 16
    plan = plan_build(options, inputs)
    assert GROUP_SPREAD // 2 < len(plan.partitions) < 2 * GROUP_SPREAD  # of 500 files
    assert [f.relpath for p in plan.partitions for f in p.files] == [f.relpath for f in inputs]
    for p in plan.partitions:
        assert p.nbytes == sum(f.size for f in p.files)
        assert p.nbytes <= most or len(p.files) == 1  # a file of ``most`` bytes or more: alone
        assert p.span.whole
    # under a small partition size, groups are smaller: at most 256 bytes here
    options = _options(tmp_path / "tiny", tmp_path / "out", tokenizer_dir, partition_size=4096)
    plan = plan_build(options, inputs)
    assert 150 < len(plan.partitions) < 300
    assert [f.relpath for p in plan.partitions for f in p.files] == [f.relpath for f in inputs]
    assert all(p.nbytes <= 256 or len(p.files) == 1 for p in plan.partitions)
    # the recorded plan (parts/build.json) gives the same partitions back
    again = plan_from_json(json.loads(json.dumps(plan_to_json(plan))), options, inputs)
    assert again.partitions == plan.partitions


def test_a_file_over_the_group_size_keeps_a_partition_of_its_own(tmp_path, tokenizer_dir):
    folder = tmp_path / "mixed"
    folder.mkdir()
    (folder / "a.jsonl").write_text(json.dumps({"text": "small"}) + "\n")
    (folder / "b.jsonl").write_text(json.dumps({"text": "x" * 200}) + "\n")
    (folder / "c.jsonl").write_text(json.dumps({"text": "small"}) + "\n")
    (folder / "d.jsonl").write_text(json.dumps({"text": "tiny"}) + "\n")
    for k in range(200):  # enough small bytes that 1/64 of them holds several small files
        (folder / f"e{k:03d}.jsonl").write_text(json.dumps({"text": "small"}) + "\n")
    options = _options(folder, tmp_path / "out", tokenizer_dir, partition_size=16 * 128)
    plan = plan_build(options)
    groups = [[f.relpath for f in p.files] for p in plan.partitions]
    assert groups[:2] == [["a.jsonl"], ["b.jsonl"]]  # b: over partition_size / 16, alone
    assert groups[2][:3] == ["c.jsonl", "d.jsonl", "e000.jsonl"]


def test_a_cache_of_tiny_files_equals_one_of_the_same_records_in_one_file(tmp_path, tokenizer_dir):
    texts = _tiny_files(tmp_path / "tiny", 500, bad={7: "not json", 300: '{"no": "text"}'})
    one = tmp_path / "one"
    one.mkdir()
    (one / "all.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    grouped = _built(tmp_path / "tiny", tmp_path / "a", tokenizer_dir)
    single = _built(one, tmp_path / "b", tokenizer_dir)
    assert grouped.manifest["partitions"] < 100
    a, b = list(grouped.iter_sequences()), list(single.iter_sequences())
    assert [s.ids.tolist() for s in a] == [s.ids.tolist() for s in b]
    # every row names its own file and record; the same text as the one-file cache's row
    for s, t in zip(a, b):
        assert s.provenance.source == f"f{t.provenance.record:04d}.jsonl"
        assert s.provenance.record == 0
    inputs = grouped.manifest["inputs"]
    assert [f["relpath"] for f in inputs] == [f"f{k:04d}.jsonl" for k in range(500)]
    for k, entry in enumerate(inputs):
        path = os.path.join(tmp_path, "tiny", entry["relpath"])
        with open(path, "rb") as f:
            assert entry["sha256"] == hashlib.sha256(f.read()).hexdigest()
        assert entry["documents"] == 1
        assert entry["bad_records"] == (1 if k in (7, 300) else 0)
    with open(os.path.join(tmp_path, "a", "quarantine.jsonl")) as f:
        quarantine = [json.loads(line) for line in f]
    assert [(q["source"], q["record"], q["line"], q["reason"]) for q in quarantine] == [
        ("f0007.jsonl", 1, 2, "not_json"),
        ("f0300.jsonl", 1, 2, "no_text_field"),
    ]
    # the data component of the key: the files' hashes, or the given data version
    ungrouped = _built(tmp_path / "tiny", tmp_path / "c", tokenizer_dir, partition_size="1KiB")
    assert ungrouped.manifest["partitions"] > 300  # files over 64 bytes: one partition each
    assert grouped.manifest["key"] == ungrouped.manifest["key"]
    assert grouped.manifest["inputs"] == ungrouped.manifest["inputs"]
    versioned = _built(tmp_path / "tiny", tmp_path / "d", tokenizer_dir, data_version="v7")
    assert "v7" in json.dumps(versioned.manifest["key"]["components"])


def test_grouped_partitions_give_the_same_bytes_for_any_workers_and_after_a_kill(
    tmp_path, tokenizer_dir
):
    _tiny_files(tmp_path / "tiny", 120, bad={5: "{broken", 60: "[1, 2]"})
    more = {"partition_size": 16 * 1024, "shard_size": 4096, "buckets": "16,64"}
    reference = str(tmp_path / "ref")
    build_cache(_options(tmp_path / "tiny", reference, tokenizer_dir, **more))
    manifest = open_cache(reference).manifest
    assert 5 < manifest["partitions"] < 100  # groups of several files
    assert any("sources" in s for s in manifest["shards"])
    expected = folder_files(reference)

    pooled = str(tmp_path / "pooled")
    build_cache(_options(tmp_path / "tiny", pooled, tokenizer_dir, **{**more, "workers": 2}))
    assert folder_files(pooled) == expected

    killed = str(tmp_path / "killed")
    args = ["-i", str(tmp_path / "tiny"), "-t", tokenizer_dir, "-o", killed, "--workers", "1",
            "--partition-size", str(more["partition_size"]), "--shard-size", "4096",
            "--buckets", "16,64", "-q"]  # fmt: skip
    result = subprocess.run(
        [sys.executable, "-m", "shardcache.cli", "build", *args], cwd=REPO,
        env={**os.environ, **kill_env("part:3")}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == -signal.SIGKILL, result.stderr
    report = build_cache(_options(tmp_path / "tiny", killed, tokenizer_dir, **more))
    assert report.resumed_partitions >= 2
    assert folder_files(killed) == expected


@pytest.mark.parametrize("fmt", ["jsonl.zst", "parquet"])
def test_small_files_of_other_formats_group_too(fmt, tmp_path, tokenizer_dir):
    from conftest import write_records

    folder = tmp_path / "c"
    folder.mkdir()
    texts = make_texts(30, seed=9, max_words=10)
    for k in range(200):
        write_records(str(folder / f"f{k:03d}.{fmt}"),
                      [{"text": t} for t in texts[k % 10 * 3 : k % 10 * 3 + 3]], fmt)  # fmt: skip
    out = str(tmp_path / "out")
    build_cache(_options(folder, out, tokenizer_dir))
    cache = open_cache(out)
    assert cache.manifest["partitions"] < 100
    seen = sorted((s.provenance.source, s.provenance.record) for s in cache.iter_sequences())
    assert seen == [(f"f{k:03d}.{fmt}", r) for k in range(200) for r in range(3)]
