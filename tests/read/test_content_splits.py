"""Content-keyed splits (issue 57): a document's side is a function of its content.

The same texts re-cut into other files, or one file given twice, never put a text on two sides
and never move one; a rebuild with other shard sizes keeps every side; a cache built before
content keys still reads with its path keys, and says so.
"""

from __future__ import annotations

import json
import logging
import os
import shutil

import numpy as np
import pytest
from click.testing import CliRunner

from shardcache import ConfigError, ShardDataset, Split, StateError, open_cache
from shardcache.cli import main
from shardcache.read.selection.splits import SPLIT_NAMES, split_ids, split_summary
from shardcache.store.verify import verify_cache

SPLIT = Split(validation=0.2, test=0.1)
DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
#: What every build here shares: pieces of long documents (truncation="split") in 3 buckets.
OPTIONS = {"max_length": 64, "truncation": "split", "buckets": "8,16,32", "shard_size": 4096}


def _texts(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota"]
    # some longer than max_length (cut in pieces); the number makes every text distinct
    return [" ".join(rng.choice(words, int(rng.integers(1, 90)))) + f" n{i}" for i in range(n)]


def _write(folder, name: str, texts: list[str]) -> None:
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as out:
        for text in texts:
            out.write(json.dumps({"text": text}) + "\n")


def _sides_by_text(path: str, split: Split = SPLIT) -> dict[str, set[str]]:
    """Every input text of a cache (read back through its provenance) -> the sides it is on."""
    inputs = open_cache(path).manifest["options"]["source"]["inputs"][0]
    texts: dict[tuple[str, int], str] = {}
    for root, _, files in os.walk(inputs):
        for name in files:
            rel = os.path.relpath(os.path.join(root, name), inputs)
            with open(os.path.join(root, name), encoding="utf-8") as f:
                texts.update({(rel, k): json.loads(line)["text"] for k, line in enumerate(f)})
    out: dict[str, set[str]] = {}
    with open_cache(path) as cache:
        side = np.empty(cache.num_sequences, dtype=object)
        for name in SPLIT_NAMES:
            side[split_ids(cache, split, name)] = name
        for seq in cache.iter_sequences():
            text = texts[(seq.provenance.source, seq.provenance.record)]
            out.setdefault(text, set()).add(side[seq.sample_id])
    return out


def _split_json(path: str, spec: str) -> dict:
    got = CliRunner().invoke(main, ["info", path, "--split", spec, "--json"])
    assert got.exit_code == 0, got.output
    return json.loads(got.output)["splits"]


@pytest.fixture(scope="module")
def texts() -> list[str]:
    return _texts(1000)


@pytest.fixture(scope="module")
def build(tmp_path_factory, tokenizer_dir):
    from shardcache.builder.run import build_cache
    from shardcache.config import build_options_from_mapping

    def run(folder, **options) -> str:
        out = str(tmp_path_factory.mktemp("cache") / "cache")
        values = {"input": str(folder), "tokenizer": tokenizer_dir, "output": out,
                  "workers": 1, **OPTIONS, **options}  # fmt: skip
        build_cache(build_options_from_mapping(values))
        return out

    return run


@pytest.fixture(scope="module")
def three_files(tmp_path_factory, texts, build) -> str:
    folder = tmp_path_factory.mktemp("three")
    for f in range(3):
        _write(folder, f"part-{f}.jsonl", texts[f::3])
    return build(folder)


@pytest.fixture(scope="module")
def twice(tmp_path_factory, texts, build) -> str:
    """One cache whose inputs hold the same file twice (``a/x.jsonl``, ``b/x.jsonl``)."""
    folder = tmp_path_factory.mktemp("twice")
    _write(folder, "a/x.jsonl", texts)
    _write(folder, "b/x.jsonl", texts)
    return build(folder)


def test_the_same_texts_recut_into_five_files_move_no_document(
    tmp_path_factory, texts, build, three_files
):
    folder = tmp_path_factory.mktemp("five")
    order = np.random.default_rng(1).permutation(len(texts))
    for f, part in enumerate(np.array_split(order, 5)):
        _write(folder, f"shard_{f}_of_5.jsonl", [texts[k] for k in part])
    before, after = _sides_by_text(three_files), _sides_by_text(build(folder))
    assert set(before) == set(after) == set(texts)
    on_two = [t for t in texts if len(before[t]) > 1 or len(after[t]) > 1]
    moved = [t for t in texts if before[t] != after[t]]
    assert (len(on_two), len(moved)) == (0, 0)
    counts = {name: sum(before[t] == {name} for t in texts) for name in SPLIT_NAMES}
    assert abs(counts["validation"] / 1000 - 0.2) < 0.05 and abs(counts["test"] / 1000 - 0.1) < 0.04


def test_a_file_given_twice_puts_no_document_on_two_sides(twice, texts):
    sides = _sides_by_text(twice)
    assert len(sides) == len(texts)
    assert [t for t, s in sides.items() if len(s) > 1] == []
    summary = _split_json(twice, "validation=0.2,test=0.1")
    assert summary["key"] == "content" and summary["documents_on_several_sides"] == 0
    plain = CliRunner().invoke(main, ["info", twice])
    assert plain.exit_code == 0 and "split keys   content" in plain.output
    # each text twice: every side holds an even number of sequences and documents
    assert all(summary[name]["sequences"] % 2 == 0 for name in SPLIT_NAMES)


def test_path_keys_are_kept_on_request_and_info_counts_what_they_leak(twice):
    path = Split(validation=0.2, test=0.1, key="path")
    sides = _sides_by_text(twice, path)
    leaked = sum(len(s) > 1 for s in sides.values())
    assert leaked > 0  # the old behaviour: a copy of a text may fall on another side
    summary = _split_json(twice, "validation=0.2,test=0.1,key=path")
    assert summary["key"] == "path" and summary["documents_on_several_sides"] == leaked
    with open_cache(twice) as cache:
        assert split_summary(cache, path) == summary
        keys = cache.document_keys("path")
        assert np.array_equal(path.labels(keys), Split(validation=0.2, test=0.1).labels(keys))
    text = CliRunner().invoke(main, ["info", twice, "--split", "validation=0.2,key=path"])
    assert text.exit_code == 0 and "on more than one side" in text.output


def test_a_rebuild_with_other_shard_sizes_keeps_every_side(tmp_path_factory, texts, build,
                                                           three_files):  # fmt: skip
    folder = open_cache(three_files).manifest["options"]["source"]["inputs"][0]
    other = build(folder, buckets="12,40", shard_size=20000)
    assert _sides_by_text(other) == _sides_by_text(three_files)
    with open_cache(three_files) as a, open_cache(other) as b:
        assert len(a.shards) != len(b.shards)
        by_doc = [
            {(s.provenance.source, s.provenance.record): int(k) for s, k in pairs}
            for pairs in (zip(c.iter_sequences(), c.document_keys()) for c in (a, b))
        ]
    assert by_doc[0] == by_doc[1]  # every document keeps its key


def test_every_piece_of_a_document_and_every_copy_share_one_key(twice):
    with open_cache(twice) as cache:
        keys = cache.document_keys()
        docs = [(s.provenance.source, s.provenance.record, s.provenance.piece)
                for s in cache.iter_sequences()]  # fmt: skip
    by_record: dict[tuple[str, int], set[int]] = {}
    for (source, record, _), key in zip(docs, keys.tolist()):
        by_record.setdefault((source.split("/", 1)[1], record), set()).add(key)
    assert all(len(k) == 1 for k in by_record.values())  # pieces and both copies
    assert len({next(iter(k)) for k in by_record.values()}) == len(by_record)  # texts differ
    assert any(p > 0 for *_, p in docs)  # (some documents were cut in pieces)


def test_content_keys_are_in_the_index_checked_by_verify_and_not_in_the_cache_key(
    three_files, tmp_path
):
    copy = str(tmp_path / "cache")
    shutil.copytree(three_files, copy)
    with open_cache(copy) as cache:
        entry = cache.manifest["index"]["content_keys"]
        assert entry["name"] == "index/content_keys.npy"
        keys = np.load(os.path.join(copy, entry["name"]))
        assert keys.dtype == np.uint64 and len(keys) == cache.num_sequences
        assert "content_keys" not in json.dumps(cache.manifest["key"])
    assert verify_cache(copy).ok
    path = os.path.join(copy, "index", "content_keys.npy")
    with open(path, "r+b") as f:
        f.seek(-3, os.SEEK_END)
        byte = f.read(1)
        f.seek(-3, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0xFF]))
    report = verify_cache(copy)
    assert not report.ok and "content_keys" in str(report.to_json())


def test_a_state_of_path_keys_is_refused_by_a_content_keyed_reader(three_files):
    a = ShardDataset(three_files, 256, split="validation", splits=Split(validation=0.2,
                                                                        key="path"))  # fmt: skip
    b = ShardDataset(three_files, 256, split="validation", splits=Split(validation=0.2))
    assert a.state_dict()["split"]["key"] == "path"
    with pytest.raises(StateError, match="split"):
        b.load_state_dict(a.state_dict())
    b.load_state_dict(b.state_dict())


def test_split_key_is_checked():
    with pytest.raises(ConfigError, match="key"):
        Split(validation=0.1, key="file")
    assert Split(validation=0.1).key == "content"


@pytest.fixture()
def old_cache(tmp_path) -> str:
    """A committed cache built before content keys (path keys only)."""
    path = str(tmp_path / "plain")
    shutil.copytree(os.path.join(DATA, "epochs", "plain"), path)
    return path


def test_an_old_cache_reads_with_path_keys_and_says_so(old_cache, caplog):
    with caplog.at_level(logging.INFO, logger="shardcache"):
        with open_cache(old_cache) as cache:
            assert cache.content_keys is None
            path = cache.document_keys("path")
            assert np.array_equal(cache.document_keys(), path)  # what it has
            summary = split_summary(cache, SPLIT)
            want = split_ids(cache, Split(validation=0.2, test=0.1, key="path"), "validation")
            assert np.array_equal(split_ids(cache, SPLIT, "validation"), want)
        ds = ShardDataset(old_cache, 256, split="validation", splits=SPLIT)
        ShardDataset(old_cache, 256, split="train", splits=SPLIT)
    assert summary["key"] == "path" and summary["documents_on_several_sides"] is None
    notes = [r for r in caplog.records if "path keys" in r.getMessage()]
    assert len(notes) == 1 and notes[0].levelno == logging.INFO  # once per cache and process
    got = sorted(int(i) for b in ds for i in b["meta"]["sample_ids"] if i >= 0)
    assert got == want.tolist()
    text = CliRunner().invoke(main, ["info", old_cache, "--split", "validation=0.2"])
    assert text.exit_code == 0 and "path keys" in text.output and "rebuild" in text.output
    plain = CliRunner().invoke(main, ["info", old_cache])  # without --split too
    assert plain.exit_code == 0 and "split keys   path keys" in plain.output
    assert verify_cache(old_cache).ok


def test_a_cache_at_a_url_reads_its_content_keys(three_files):
    url = "file://" + os.path.abspath(three_files)
    with open_cache(three_files) as local, open_cache(url) as remote:
        assert remote.remote is not None
        assert np.array_equal(remote.content_keys, local.content_keys)
        assert np.array_equal(split_ids(remote, SPLIT, "test"), split_ids(local, SPLIT, "test"))
    assert verify_cache(url).ok


def test_a_conversation_given_twice_has_one_key(tmp_path, build_cache, chatml_tokenizer_dir):
    from conftest import make_conversations, write_records

    convs = make_conversations(60, seed=2)
    for name in ("a", "b"):  # the same file twice, in another order the second time
        (tmp_path / name).mkdir()
        order = convs if name == "a" else convs[::-1]
        write_records(str(tmp_path / name / "x.jsonl"), [{"messages": m} for m in order], "jsonl")
    with open_cache(build_cache(str(tmp_path), chatml_tokenizer_dir, chat=True)) as cache:
        keys = cache.document_keys()
        records = [(s.provenance.source, s.provenance.record) for s in cache.iter_sequences()]
        summary = split_summary(cache, SPLIT)
    by_conv: dict[str, set[int]] = {}
    for (source, record), key in zip(records, keys.tolist()):
        conv = convs[record] if source.startswith("a/") else convs[::-1][record]
        by_conv.setdefault(json.dumps(conv), set()).add(key)
    assert len(by_conv) == 60 and all(len(k) == 1 for k in by_conv.values())
    assert len({next(iter(k)) for k in by_conv.values()}) == 60
    assert summary["documents_on_several_sides"] == 0


def test_both_sides_of_a_pair_share_its_content_key(pairs_cache):
    with open_cache(pairs_cache) as cache:
        keys = cache.content_keys
        assert keys is not None and np.array_equal(keys[0::2], keys[1::2])
        assert len(np.unique(keys)) == cache.num_sequences // 2  # one per pair
    # verify checks that too (what else it reports of this cache is not about content keys)
    assert not [p for p in verify_cache(pairs_cache).problems if "content_keys" in p.file]
