"""One partition's map step: quarantine order under thread timing (issue 12 item 8) and the
input changing while it is read (item 9)."""

from __future__ import annotations

import json
import os
import textwrap

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import CHATML_TEMPLATE, make_conversations
from shardcache.builder.bucket import assign_buckets
from shardcache.builder.partition import by_bucket
from shardcache.builder.run import build_cache
from shardcache.builder.tokenize import Encoded
from shardcache.config import build_options_from_mapping

# A template that refuses conversations whose user says BOOM (a template-side bad record).
BOOM_TEMPLATE = (
    "{% for m in messages %}{% if m['content'] == 'BOOM' %}{{ raise_exception('boom') }}"
    "{% endif %}{% endfor %}" + CHATML_TEMPLATE
)

# Loaded by the spawned build workers (PYTHONPATH): slows the reader thread or the consumer.
SLOWDOWN = textwrap.dedent(
    """
    import os
    import time

    MODE = os.environ.get("SHARDCACHE_TEST_SLOW")
    if MODE:
        import tests_slowdown
        tests_slowdown.apply(MODE)
    """
)
SLOWDOWN_MODULE = textwrap.dedent(
    """
    import time


    def apply(mode):
        from shardcache.builder import chat, partition

        if mode == "reader":  # the reader thread (encode_ahead's): slow on every bad record
            iter_batches = partition.iter_text_batches

            def slow_batches(*args, on_bad=None, **kwargs):
                def slow_bad(*bad_args):
                    time.sleep(0.002)
                    on_bad(*bad_args)

                yield from iter_batches(*args, on_bad=slow_bad, **kwargs)

            partition.iter_text_batches = slow_batches
        else:  # the consumer: slow on every batch, so the reader runs ahead
            finish = chat.ChatEncoder.finish

            def slow_finish(self, *args, **kwargs):
                time.sleep(0.02)
                return finish(self, *args, **kwargs)

            chat.ChatEncoder.finish = slow_finish
    """
)


@pytest.fixture()
def bad_chat_corpus(tmp_path):
    """One jsonl file of 240 conversations: every 4th is reader-side bad (no messages list),
    every 5th (of the rest) is refused by the template."""
    folder = tmp_path / "chat"
    folder.mkdir()
    lines = []
    for i, messages in enumerate(make_conversations(240, seed=3)):
        if i % 4 == 1:
            lines.append(json.dumps({"messages": "not a conversation"}))
            continue
        if i % 5 == 2:
            messages = [{"role": "user", "content": "BOOM"}, *messages]
        lines.append(json.dumps({"messages": messages}))
    (folder / "a.jsonl").write_text("\n".join(lines) + "\n")
    template = tmp_path / "boom.jinja"
    template.write_text(BOOM_TEMPLATE)
    return str(folder), str(template)


def _build_slowed(folder, template, tokenizer, out, workers, mode, monkeypatch, tmp_path) -> str:
    hooks = tmp_path / "hooks"
    hooks.mkdir(exist_ok=True)
    (hooks / "sitecustomize.py").write_text(SLOWDOWN)
    (hooks / "tests_slowdown.py").write_text(SLOWDOWN_MODULE)
    with monkeypatch.context() as m:
        m.setenv("PYTHONPATH", os.pathsep.join([str(hooks), os.environ.get("PYTHONPATH", "")]))
        m.setenv("SHARDCACHE_TEST_SLOW", mode)
        m.syspath_prepend(str(hooks))
        if workers == 1:  # this process: patch it here, undone by the context
            from shardcache.builder import chat, partition

            m.setattr(partition, "iter_text_batches", partition.iter_text_batches)
            m.setattr(chat.ChatEncoder, "finish", chat.ChatEncoder.finish)
            __import__("tests_slowdown").apply(mode)
        values = {"input": folder, "tokenizer": tokenizer, "output": out, "workers": workers,
                  "chat": True, "chat_template": template, "batch_docs": 8,
                  "partition_size": "16KiB", "on_error": "skip",
                  "max_bad_fraction": 0.5}  # fmt: skip
        build_cache(build_options_from_mapping(values))
    return out


def test_chat_builds_with_bad_records_are_byte_reproducible(
    bad_chat_corpus, chatml_tokenizer_dir, tmp_path, monkeypatch
):
    folder, template = bad_chat_corpus
    manifests, quarantines = {}, {}
    for workers in (1, 2):
        for mode in ("reader", "consumer"):
            out = str(tmp_path / f"out-{workers}-{mode}")
            _build_slowed(folder, template, chatml_tokenizer_dir, out, workers, mode,
                          monkeypatch, tmp_path)  # fmt: skip
            with open(os.path.join(out, "manifest.json"), "rb") as f:
                manifests[workers, mode] = f.read()
            with open(os.path.join(out, "quarantine.jsonl"), "rb") as f:
                quarantines[workers, mode] = f.read()
    records = [json.loads(line) for line in quarantines[1, "reader"].splitlines()]
    reasons = {r["reason"] for r in records}
    assert "template_error" in reasons and len(reasons) >= 2, reasons
    assert len(set(quarantines.values())) == 1, "quarantine differs between builds"
    assert len(set(manifests.values())) == 1, "manifest differs between builds"
    assert [r["record"] for r in records] == sorted(r["record"] for r in records)
    manifest = json.loads(manifests[1, "reader"])
    assert manifest["partitions"] > 1
    assert sum(manifest["stats"]["bad_records"].values()) == len(records)


def _rewrite(path: str, how: str) -> None:
    """Change an input in place: truncate it to half, or rewrite it with other bytes of the
    same size (the mtime moved one second on, as any later write moves it; or, for
    ``"rewrite-same-mtime"``, put back as it was, as ``cp -p`` would)."""
    with open(path, "rb") as f:
        data = f.read()
    data = data[: len(data) // 2] if how == "truncate" else data.replace(b"a", b"e")
    st = os.stat(path)
    with open(path, "r+b") as f:
        f.write(data)
        f.truncate(len(data))
    keep = how == "rewrite-same-mtime"
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + (0 if keep else 1_000_000_000)))


@pytest.mark.parametrize("how", ["truncate", "rewrite"])
@pytest.mark.parametrize("partition_size", ["4KiB", "64MiB"])  # split / whole-file partitions
def test_an_input_changed_during_the_build_fails_naming_the_file(
    corpus, tokenizer_dir, tmp_path, monkeypatch, how, partition_size
):
    from shardcache import SourceError
    from shardcache.builder import fault_points

    folder, _ = corpus("jsonl", n_files=1, docs=200)
    path = os.path.join(folder, "part-00.jsonl")
    out = str(tmp_path / "out")
    changed = []

    def change_after_the_first_batch(event: str) -> None:
        if event == "batch" and not changed:
            changed.append(event)
            _rewrite(path, how)

    monkeypatch.setattr(fault_points, "hook", change_after_the_first_batch)
    values = {"input": folder, "tokenizer": tokenizer_dir, "output": out, "workers": 1,
              "batch_docs": 16, "partition_size": partition_size}  # fmt: skip
    with pytest.raises(SourceError, match=r"part-00\.jsonl.*changed") as err:
        build_cache(build_options_from_mapping(values))
    assert changed
    assert "--force" in str(err.value)
    assert not os.path.exists(os.path.join(out, "manifest.json"))


@pytest.mark.parametrize("how", ["rewrite", "rewrite-same-mtime"])
def test_an_input_changed_between_plan_and_read_fails(corpus, tokenizer_dir, tmp_path, how):
    """A later partition of a split file opens a file that is no longer the planned one (with
    the same size and mtime: only the range's sha256, computed by the plan, tells)."""
    from shardcache import SourceError
    from shardcache.builder.build_plan import plan_build
    from shardcache.builder.encoders import encoder_for
    from shardcache.builder.partition import build_partition
    from shardcache.builder.report import Progress

    folder, _ = corpus("jsonl", n_files=1, docs=200)
    path = os.path.join(folder, "part-00.jsonl")
    out = str(tmp_path / "out")
    for sub in ("shards", "parts"):
        os.makedirs(os.path.join(out, sub))
    values = {"input": folder, "tokenizer": tokenizer_dir, "output": out, "workers": 1,
              "partition_size": "4KiB"}  # fmt: skip
    options = build_options_from_mapping(values)
    plan = plan_build(options)
    assert len(plan.partitions) > 2
    _rewrite(path, how)
    with pytest.raises(SourceError, match=r"part-00\.jsonl.*changed"):
        build_partition(plan, plan.partitions[1], encoder_for(options, None), Progress())


@settings(max_examples=80, deadline=None)
@given(lengths=st.lists(st.integers(1, 200), max_size=40), with_mask=st.booleans())
def test_rows_grouped_by_bucket_are_each_buckets_rows_in_input_order(lengths, with_mask):
    edges = (4, 16, 64)
    lengths = np.asarray(lengths, dtype=np.int64)
    n = len(lengths)
    tokens = np.arange(int(lengths.sum()), dtype=np.uint32)
    mask = tokens % 3 == 0 if with_mask else None
    doc_index = np.arange(n, dtype=np.int64) // 2  # two pieces a document
    piece = (np.arange(n) % 2).astype(np.int32)
    records = np.arange(n // 2 + 1, dtype=np.int64) * 10 + 7
    encoded = Encoded(tokens, lengths, doc_index, piece, mask)
    groups = by_bucket(encoded, records, edges)
    buckets = assign_buckets(lengths, edges)
    assert [b for b, _ in groups] == sorted(set(buckets.tolist()))
    for b, got in groups:
        rows = buckets == b
        token_rows = np.repeat(rows, lengths)
        assert np.array_equal(got.tokens, tokens[token_rows])
        assert got.tokens.base is None or got.tokens.base is not tokens  # a copy of its own
        assert np.array_equal(got.lengths, lengths[rows])
        assert np.array_equal(got.doc_index, doc_index[rows])
        assert np.array_equal(got.piece, piece[rows])
        assert np.array_equal(got.records, records[doc_index[rows]])
        assert (got.mask is None) == (mask is None)
        if mask is not None:
            assert np.array_equal(got.mask, mask[token_rows])
