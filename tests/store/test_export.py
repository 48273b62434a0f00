"""``export_cache`` and ``shardcache export``: Megatron .bin/.idx and HF datasets folders, read back
with the real readers (megatron-core's ``IndexedDataset``, ``datasets.load_from_disk``)."""

from __future__ import annotations

import json
import os
import struct
import warnings

import numpy as np
import pytest
from click.testing import CliRunner

from conftest import make_conversations, write_records
from shardcache.cli import main
from shardcache.errors import CacheError, CacheNotFoundError, ConfigError
from shardcache.store.cache import open_cache
from shardcache.store.export import ExportOptions, export_cache, megatron_dtype


def _indexed_dataset():
    """megatron-core's reader; its import warns that Apex/Transformer Engine are missing."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pytest.importorskip("megatron.core")
        from megatron.core.datasets.indexed_dataset import IndexedDataset
    return IndexedDataset


def _cache_sequences(path):
    with open_cache(path) as cache:
        return cache.read_many(np.arange(cache.num_sequences))


@pytest.fixture()
def split_cache(corpus, tokenizer_dir, build_cache):
    """Several buckets and shards, split documents (pieces of one record) included."""
    folder, _ = corpus("jsonl", n_files=2, docs=60)
    return build_cache(folder, tokenizer_dir, max_length=24, truncation="split",
                       buckets="4,8,16,24", shard_size=4096)  # fmt: skip


@pytest.fixture()
def chat_cache(tmp_path, chatml_tokenizer_dir, build_cache):
    records = [{"messages": m} for m in make_conversations(30, seed=3)]
    path = write_records(str(tmp_path / "chat.jsonl"), records, "jsonl")
    return build_cache(path, chatml_tokenizer_dir, chat=True, max_length=64)


def _parse_megatron_index(path):
    """The .idx fields parsed by hand (the format megatron-core's _IndexReader reads)."""
    with open(path, "rb") as f:
        data = f.read()
    assert data[:9] == b"MMIDIDX\x00\x00"
    version, code, sequences, documents = struct.unpack("<QBQQ", data[9:34])
    lengths = np.frombuffer(data, np.int32, sequences, 34)
    pointers = np.frombuffer(data, np.int64, sequences, 34 + 4 * sequences)
    docs = np.frombuffer(data, np.int64, documents, 34 + 12 * sequences)
    assert len(data) == 34 + 12 * sequences + 8 * documents
    return version, code, lengths, pointers, docs


@pytest.mark.slow  # importing megatron.core takes 5-20 s
def test_megatron_round_trip_with_megatron_core(split_cache, tmp_path):
    IndexedDataset = _indexed_dataset()
    prefix = str(tmp_path / "out" / "train_text_document")
    report = export_cache(split_cache, prefix, ExportOptions("megatron", chunk_tokens=50))
    assert sorted(os.listdir(tmp_path / "out")) == [
        "train_text_document.bin",
        "train_text_document.idx",
    ]
    want = _cache_sequences(split_cache)
    assert report.sequences == len(want) and report.tokens == sum(len(s) for s in want)
    with open_cache(split_cache) as cache:
        dtype = megatron_dtype(cache)
        assert cache.manifest["tokenizer"]["vocab_size"] < 65500 and dtype == np.uint16
        # split documents are in the cache: their pieces stay documents of their own
        assert any(cache.lookup(i).piece > 0 for i in range(cache.num_sequences))
    dataset = IndexedDataset(prefix)
    assert len(dataset) == len(want)
    assert dataset.index.dtype == np.uint16
    np.testing.assert_array_equal(dataset.sequence_lengths, [len(s) for s in want])
    np.testing.assert_array_equal(dataset.document_indices, np.arange(len(want) + 1))
    for i, ids in enumerate(want):
        np.testing.assert_array_equal(dataset[i], ids)
    np.testing.assert_array_equal(dataset.get(3, offset=1, length=2), want[3][1:3])
    del dataset


def test_megatron_index_layout_parsed_by_hand(split_cache, tmp_path, monkeypatch):
    """Independent of megatron-core: the bytes of .idx and .bin as the format defines them."""
    from shardcache.store import export

    monkeypatch.setattr(export, "INDEX_BLOCK", 13)  # the index is written in blocks: their edges
    prefix = str(tmp_path / "doc")
    export_cache(split_cache, prefix, ExportOptions("megatron", chunk_tokens=7))
    want = _cache_sequences(split_cache)
    version, code, lengths, pointers, docs = _parse_megatron_index(prefix + ".idx")
    assert (version, code) == (1, 8)  # uint16
    np.testing.assert_array_equal(lengths, [len(s) for s in want])
    np.testing.assert_array_equal(pointers, 2 * np.concatenate([[0], np.cumsum(lengths)[:-1]]))
    np.testing.assert_array_equal(docs, np.arange(len(want) + 1))
    tokens = np.fromfile(prefix + ".bin", dtype=np.uint16)
    np.testing.assert_array_equal(tokens, np.concatenate(want))


@pytest.fixture()
def big_vocab_cache(tmp_path, big_vocab_dir, build_cache):
    """Token ids past 65535: Megatron's int32."""
    texts = [" ".join(f"w{(i * 7919 + k) % 65530}" for k in range(i % 9 + 1)) for i in range(40)]
    texts.append("<extra_9> w1")
    path = write_records(str(tmp_path / "big.jsonl"), [{"text": t} for t in texts], "jsonl")
    return build_cache(path, big_vocab_dir)


def test_megatron_int32_for_a_large_vocabulary(big_vocab_cache, tmp_path):
    prefix = str(tmp_path / "big")
    export_cache(big_vocab_cache, prefix, ExportOptions("megatron"))
    want = _cache_sequences(big_vocab_cache)
    assert max(int(s.max()) for s in want) > 65535
    _, code, lengths, pointers, _ = _parse_megatron_index(prefix + ".idx")
    assert code == 4  # int32
    np.testing.assert_array_equal(pointers, 4 * np.concatenate([[0], np.cumsum(lengths)[:-1]]))
    np.testing.assert_array_equal(np.fromfile(prefix + ".bin", np.int32), np.concatenate(want))


@pytest.mark.slow  # importing megatron.core takes 5-20 s
def test_megatron_core_reads_an_int32_export(big_vocab_cache, tmp_path):
    IndexedDataset = _indexed_dataset()
    prefix = str(tmp_path / "big")
    export_cache(big_vocab_cache, prefix, ExportOptions("megatron"))
    dataset = IndexedDataset(prefix)
    assert dataset.index.dtype == np.int32
    for i, ids in enumerate(_cache_sequences(big_vocab_cache)):
        np.testing.assert_array_equal(dataset[i], ids)
    del dataset


def test_hf_round_trip_with_datasets(split_cache, tmp_path):
    datasets = pytest.importorskip("datasets")
    out = str(tmp_path / "hf")
    # a small shard size: several data files, each written in several record batches
    report = export_cache(split_cache, out,
                          ExportOptions("hf", shard_size_bytes=600, chunk_tokens=40))  # fmt: skip
    want = _cache_sequences(split_cache)
    data_files = sorted(n for n in os.listdir(out) if n.endswith(".arrow"))
    assert len(data_files) > 1 and report.files[-2:] == [
        os.path.join(out, "dataset_info.json"),
        os.path.join(out, "state.json"),
    ]
    dataset = datasets.load_from_disk(out)
    assert dataset.column_names == ["input_ids"]
    assert dataset.features["input_ids"].feature.dtype == "int32"
    assert len(dataset) == len(want)
    assert [row["input_ids"] for row in dataset] == [s.tolist() for s in want]
    assert not any(name.endswith(".tmp") for name in os.listdir(tmp_path))


def test_hf_chat_cache_keeps_loss_masks(chat_cache, tmp_path):
    datasets = pytest.importorskip("datasets")
    out = str(tmp_path / "chat-hf")
    report = export_cache(chat_cache, out, ExportOptions("hf"))
    assert report.loss_mask
    with open_cache(chat_cache) as cache:
        ids = cache.read_many(np.arange(cache.num_sequences))
        masks = cache.read_masks(np.arange(cache.num_sequences))
    dataset = datasets.load_from_disk(out)
    assert dataset.column_names == ["input_ids", "loss_mask"]
    assert dataset.features["loss_mask"].feature.dtype == "int8"
    assert [r["input_ids"] for r in dataset] == [s.tolist() for s in ids]
    assert [r["loss_mask"] for r in dataset] == [m.astype(int).tolist() for m in masks]
    assert any(0 < sum(m) < len(m) for m in dataset["loss_mask"])


def test_megatron_refuses_a_chat_cache_unless_masks_are_dropped(chat_cache, tmp_path):
    prefix = str(tmp_path / "mg")
    with pytest.raises(ConfigError, match="--drop-loss-mask"):
        export_cache(chat_cache, prefix, ExportOptions("megatron"))
    assert not [n for n in os.listdir(tmp_path) if n.startswith("mg")]
    export_cache(chat_cache, prefix, ExportOptions("megatron", drop_loss_mask=True))
    want = _cache_sequences(chat_cache)
    np.testing.assert_array_equal(np.fromfile(prefix + ".bin", np.uint16), np.concatenate(want))


def test_existing_output_is_refused_and_left_alone(split_cache, tmp_path):
    prefix = str(tmp_path / "m")
    with open(prefix + ".idx", "wb") as f:
        f.write(b"keep")
    with pytest.raises(CacheError, match="already exists"):
        export_cache(split_cache, prefix, ExportOptions("megatron"))
    with open(prefix + ".idx", "rb") as f:
        assert f.read() == b"keep"
    assert not os.path.exists(prefix + ".bin")
    out = tmp_path / "hf"
    out.mkdir()
    with pytest.raises(CacheError, match="already exists"):
        export_cache(split_cache, str(out), ExportOptions("hf"))
    assert os.listdir(out) == []


def test_unknown_format_and_bad_options():
    with pytest.raises(ConfigError, match="valid formats: hf, megatron"):
        ExportOptions("parquet")
    with pytest.raises(ConfigError, match="chunk_tokens"):
        ExportOptions("hf", chunk_tokens=0)


def test_not_a_cache(tmp_path):
    with pytest.raises(CacheNotFoundError):
        export_cache(str(tmp_path), str(tmp_path / "o"), ExportOptions("megatron"))


def test_a_failed_export_leaves_nothing(split_cache, tmp_path, monkeypatch):
    """A crash mid-write (here a damaged read) leaves no file under the output's names."""
    from shardcache.store.cache import Cache

    calls = []

    def failing_gather(self, *args, **kwargs):
        calls.append(1)
        if len(calls) > 2:
            raise OSError("disk gone")
        return real_gather(self, *args, **kwargs)

    real_gather = Cache.gather
    monkeypatch.setattr(Cache, "gather", failing_gather)
    for fmt, out in (("megatron", tmp_path / "m"), ("hf", tmp_path / "h")):
        calls.clear()
        with pytest.raises(OSError, match="disk gone"):
            export_cache(split_cache, str(out), ExportOptions(fmt, chunk_tokens=20))
    assert not [n for n in os.listdir(tmp_path) if n[0] in "mh"]


def test_cli_export(split_cache, chat_cache, tmp_path):
    runner = CliRunner()
    prefix = str(tmp_path / "cli" / "doc")
    result = runner.invoke(main, ["export", split_cache, "--format", "megatron", prefix, "-q"])
    assert result.exit_code == 0, result.output
    assert os.path.exists(prefix + ".bin") and os.path.exists(prefix + ".idx")
    assert "sequences" in result.output
    # existing output: a failure (exit 1) with the message, no traceback
    again = runner.invoke(main, ["export", split_cache, "--format", "megatron", prefix, "-q"])
    assert again.exit_code == 1 and "already exists" in again.output
    assert "Traceback" not in again.output
    # usage errors: exit 2
    bad = runner.invoke(main, ["export", split_cache, "--format", "parquet", str(tmp_path / "x")])
    assert bad.exit_code == 2 and "megatron" in bad.output
    chat = runner.invoke(main, ["export", chat_cache, "--format", "megatron", prefix + "2"])
    assert chat.exit_code == 2 and "--drop-loss-mask" in chat.output
    missing = runner.invoke(main, ["export", str(tmp_path), "--format", "hf", prefix + "3"])
    assert missing.exit_code == 1 and "manifest.json" in missing.output
    # --json
    out = str(tmp_path / "hf")
    result = runner.invoke(main, ["export", chat_cache, "--format", "hf", out, "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["format"] == "hf" and report["loss_mask"] is True


def test_chunks_cover_every_sequence_once_within_the_budget(monkeypatch):
    import itertools

    from shardcache.store import export

    monkeypatch.setattr(export, "INDEX_BLOCK", 777)  # blocks of lengths: their edges too
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 30, size=5000).astype(np.uint32)
    for budget in (1, 29, 100, 10**6):
        chunks = list(export._chunks(lengths, 10, 4990, budget))
        assert chunks[0][0] == 10 and chunks[-1][1] == 4990
        assert all(a[1] == b[0] for a, b in itertools.pairwise(chunks))
        sizes = [int(lengths[lo:hi].sum()) for lo, hi in chunks]
        assert all(s <= budget or hi - lo == 1 for s, (lo, hi) in zip(sizes, chunks))


# ---- atomic exports, leftovers of a killed run, an output inside the cache (issue 57) ----------

_KILLED_EXPORT = """
import os, sys
from shardcache.store.export import ExportOptions, export_cache
fmt, cache, out, kill_at = sys.argv[1:5]
renames = []
real = os.rename
def rename(src, dst, *args, **kwargs):
    renames.append(dst)
    if len(renames) == int(kill_at):
        os._exit(9)  # a SIGKILL here: no cleanup runs
    return real(src, dst, *args, **kwargs)
os.rename = rename
export_cache(cache, out, ExportOptions(fmt))
"""


def _kill_export(fmt: str, cache: str, out: str, kill_at: int) -> None:
    """Run an export in a process that dies at its ``kill_at``-th rename (before it)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _KILLED_EXPORT, fmt, cache, out, str(kill_at)],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 9, done.stderr


@pytest.mark.parametrize("kill_at", [1, 2])
def test_megatron_files_appear_together_and_a_rerun_cleans_a_killed_run(
    split_cache, tmp_path, kill_at
):
    """Killed before its first rename or between the two: never a .idx without its .bin, and a
    lone .bin is the killed run's (its temporary folder says so): the rerun removes it, writes
    both, and leaves no temporary folder."""
    prefix = str(tmp_path / "out" / "m")
    _kill_export("megatron", split_cache, prefix, kill_at)
    names = sorted(os.listdir(tmp_path / "out"))
    assert "m.idx" not in names
    assert any(n.endswith(".tmp") for n in names), names  # the killed run's temporary folder
    report = export_cache(split_cache, prefix, ExportOptions("megatron"))
    assert sorted(os.listdir(tmp_path / "out")) == ["m.bin", "m.idx"]
    clean = str(tmp_path / "clean")
    export_cache(split_cache, clean, ExportOptions("megatron"))
    for ext in (".bin", ".idx"):
        with open(prefix + ext, "rb") as a, open(clean + ext, "rb") as b:
            assert a.read() == b.read()
    assert report.files == [prefix + ".bin", prefix + ".idx"]


def test_a_lone_bin_that_no_killed_run_left_is_refused_not_removed(split_cache, tmp_path):
    prefix = str(tmp_path / "m")
    with open(prefix + ".bin", "wb") as f:
        f.write(b"mine")
    with pytest.raises(CacheError, match="already exists"):
        export_cache(split_cache, prefix, ExportOptions("megatron"))
    with open(prefix + ".bin", "rb") as f:
        assert f.read() == b"mine"


def test_hf_temporary_folders_are_removed_on_an_error_and_after_a_kill(split_cache, tmp_path):
    out = str(tmp_path / "exports" / "hf")
    _kill_export("hf", split_cache, out, 1)
    left = os.listdir(tmp_path / "exports")
    assert len(left) == 1 and left[0].startswith("hf.") and left[0].endswith(".tmp"), left
    export_cache(split_cache, out, ExportOptions("hf"))
    assert os.listdir(tmp_path / "exports") == ["hf"]


def test_an_export_inside_the_cache_folder_is_refused(split_cache, tmp_path):
    before = sorted(os.listdir(split_cache))
    for fmt, out in (("megatron", "m"), ("hf", "hf"), ("megatron", "sub/m")):
        inside = os.path.join(split_cache, out)
        with pytest.raises(ConfigError, match=rf"{inside}' is inside the cache '{split_cache}'"):
            export_cache(split_cache, inside, ExportOptions(fmt))
    assert sorted(os.listdir(split_cache)) == before
    result = CliRunner().invoke(main, ["export", split_cache, "-f", "hf", split_cache + "/x"])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
