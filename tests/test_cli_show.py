"""``shardcache show``: decoded sequences and batches, trainable tokens marked exactly as stored."""

from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest
from click.testing import CliRunner

from conftest import make_conversations, write_records
from shardcache.cli import main
from shardcache.store.cache import open_cache
from shardcache.store.show import BOUNDARY, CLOSE, OPEN, mask_runs


@pytest.fixture()
def chat_cache(tmp_path, chatml_tokenizer_dir, build_cache):
    records = [{"messages": m} for m in make_conversations(24, seed=3)]
    path = write_records(str(tmp_path / "chat.jsonl"), records, "jsonl")
    return build_cache(path, chatml_tokenizer_dir, chat=True, max_length=64)


@pytest.fixture()
def split_cache(corpus, tokenizer_dir, build_cache):
    folder, _ = corpus("jsonl", n_files=1, docs=40)
    return build_cache(folder, tokenizer_dir, max_length=12, truncation="split",
                       buckets="4,8,12")  # fmt: skip


def _show(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, ["show", *args])
    return result.exit_code, result.output


def test_json_marks_exactly_the_stored_loss_mask(chat_cache):
    with open_cache(chat_cache) as cache:
        n = cache.num_sequences
        masks = cache.read_masks(np.arange(n))
        ids = cache.read_many(np.arange(n))
    args = [arg for i in range(n) for arg in ("--index", str(i))]
    code, out = _show(chat_cache, *args, "--json", "--tokens")
    assert code == 0, out
    entries = json.loads(out)["sequences"]
    assert [e["sample_id"] for e in entries] == list(range(n))
    for entry, mask, want in zip(entries, masks, ids):
        assert entry["ids"] == want.tolist()
        assert entry["mask"] == mask.astype(int).tolist()
        assert entry["trainable"] == int(mask.sum()) > 0
        flags = np.zeros(len(want), bool)
        for run in entry["runs"]:  # the runs tile the sequence and carry the stored flags
            assert len(run["tokens"]) == run["end"] - run["start"]
            flags[run["start"] : run["end"]] = run["trainable"]
        assert (flags == mask).all()
        assert [(r["start"], r["end"]) for r in entry["runs"]] == [
            (s, e) for s, e, _ in mask_runs(mask)
        ]


def test_text_brackets_hold_exactly_the_trainable_tokens(chat_cache):
    with open_cache(chat_cache) as cache:
        masks = cache.read_masks(np.arange(cache.num_sequences))
    for sample_id in (0, 3, 7):
        code, out = _show(chat_cache, "--index", str(sample_id), "--tokens", "--no-color")
        assert code == 0, out
        body = out.split("\n", 1)[1]
        inside = re.findall(re.escape(OPEN) + "(.*?)" + re.escape(CLOSE), body, re.S)
        marked = sum(len(group.split(BOUNDARY)) for group in inside)
        assert marked == int(masks[sample_id].sum())
        assert "\x1b[" not in out


def test_color_marks_trainable_runs_instead_of_brackets(chat_cache):
    code, out = _show(chat_cache, "--index", "0", "--color")
    assert code == 0, out
    assert "\x1b[1;32m" in out and OPEN not in out


def test_sample_is_seeded_distinct_and_sized(chat_cache):
    def sampled(seed: str) -> list[int]:
        code, out = _show(chat_cache, "--sample", "5", "--seed", seed, "--json")
        assert code == 0, out
        return [e["sample_id"] for e in json.loads(out)["sequences"]]

    first = sampled("1")
    assert first == sampled("1") and len(set(first)) == 5
    assert first != sampled("2")


def test_a_split_document_shows_all_its_pieces(split_cache):
    with open_cache(split_cache) as cache:
        where = [cache.lookup(i) for i in range(cache.num_sequences)]
        split = next(p for p in where if p.piece > 0)
        pieces = sorted(
            (p.piece, i)
            for i, p in enumerate(where)
            if (p.source, p.record) == (split.source, split.record)
        )
        text = [cache.read(i).tolist() for _, i in pieces]
    want = [i for _, i in pieces]
    args = ["--source", split.source, "--record", str(split.record), "--json"]
    code, out = _show(split_cache, *args)
    assert code == 0, out
    entries = json.loads(out)["sequences"]
    assert [e["sample_id"] for e in entries] == want
    assert [e["piece"] for e in entries] == list(range(len(want)))
    assert all(e["pieces"] == want for e in entries)
    assert [e["ids"] for e in entries] == text
    code, out = _show(split_cache, "--index", str(want[-1]))
    assert f"sample ids {', '.join(map(str, want))}" in out


@pytest.mark.parametrize("mode", ["pad", "pack"])
def test_batch_shows_what_the_model_gets(chat_cache, mode):
    from shardcache import ShardDataset

    options = {"max_tokens": 256, "mode": mode, "seed": 3}
    if mode == "pack":
        options.update(seq_len=128, attention="none")
    with ShardDataset(chat_cache, rank=0, world_size=1, **options) as ds:
        batch = ds.collate_batch(ds.plan(0), 1)
    args = ["--batch", "1", "--max-tokens", "256", "--mode", mode, "--seed", "3"]
    if mode == "pack":
        args += ["--seq-len", "128"]
    code, out = _show(chat_cache, *args, "--json")
    assert code == 0, out
    data = json.loads(out)
    ids, labels = batch["input_ids"].numpy(), batch["labels"].numpy()
    assert data["shape"] == list(ids.shape)
    with open_cache(chat_cache) as cache:
        for row in data["rows"]:
            got = np.concatenate([s["ids"] for s in row["segments"]])
            assert got.tolist() == ids[row["row"]].tolist()  # the segments tile the row
            for seg in row["segments"]:
                span = slice(seg["start"], seg["end"])
                assert seg["labels"] == labels[row["row"], span].tolist()
                assert seg["trainable"] == int((labels[row["row"], span] != -100).sum())
                if not seg["padding"]:
                    stored = cache.read(seg["sample_id"])
                    offset = seg.get("offset", 0)
                    assert seg["ids"] == stored[offset : offset + len(seg["ids"])].tolist()
    code, text = _show(chat_cache, *args, "--no-color")
    assert code == 0 and text.startswith(f"batch of {ids.shape[0]} rows")


def test_errors_exit_with_a_message(chat_cache, tmp_path):
    code, out = _show(chat_cache, "--index", "100000")
    assert code == 2 and "out of range" in out
    code, out = _show(chat_cache, "--record", "1")
    assert code == 2 and "--source" in out
    code, out = _show(chat_cache, "--source", "missing.jsonl")
    assert code == 2 and "chat.jsonl" in out
    code, out = _show(chat_cache, "--tokenizer", str(tmp_path))
    assert code == 1 and "--tokenizer" in out and "Traceback" not in out
    code, out = _show(chat_cache, "--batch", "100000")
    assert code == 2 and "global batches" in out


def test_another_tokenizer_is_warned_about(chat_cache, tokenizer_dir, tmp_path):
    folder = tmp_path / "other-tok"
    shutil.copytree(tokenizer_dir, folder)
    result = CliRunner().invoke(main, ["show", chat_cache, "-n", "0", "-t", str(folder)])
    assert result.exit_code == 0, result.output
    assert "not the one the cache was built with" in result.output
