"""Packed batches that transformers models consume correctly: ``attention="mask"`` / ``"varlen"``
/ ``"none"`` checked against tiny random Qwen2 and Llama models (2 layers, CPU, sdpa and eager)
and against transformers' own ``prepare_fa_kwargs_from_position_ids``."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.modeling_flash_attention_utils import prepare_fa_kwargs_from_position_ids

from conftest import make_conversations, make_model, make_texts, write_records
from shardcache import ConfigError, ShardDataset, open_cache
from shardcache.builder.run import build_cache
from shardcache.config import build_options_from_mapping
from shardcache.read.collate.attention import block_causal_mask, segment_starts, varlen_keys
from shardcache.read.losses import model_inputs

ATOL = 1e-4
ARCH_IMPL = [(a, i) for a in ("qwen2", "llama") for i in ("sdpa", "eager")]


def positions_of(rows: list[list[int]], width: int) -> np.ndarray:
    """Position ids of rows made of segments of the given lengths, padding as one more."""
    out = []
    for lengths in rows:
        pad = width - sum(lengths)
        out.append(np.concatenate([np.arange(n) for n in [*lengths, pad] if n]))
    return np.stack(out)


# ---- pure numpy ------------------------------------------------------------------------------


def test_block_causal_mask_layout():
    pos = positions_of([[3, 2], [5]], 6)
    assert segment_starts(pos).tolist() == [[0, 0, 0, 3, 3, 5], [0, 0, 0, 0, 0, 5]]
    mask = block_causal_mask(pos)
    assert mask.shape == (2, 1, 6, 6) and mask.dtype == np.float32
    assert set(np.unique(mask).tolist()) == {0.0, float(np.finfo(np.float32).min)}
    visible = (mask == 0)[:, 0].astype(int)
    assert visible[0].tolist() == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [0, 0, 0, 1, 0, 0],  # the second document sees itself only
        [0, 0, 0, 1, 1, 0],
        [0, 0, 0, 0, 0, 1],  # padding sees itself only: no fully masked query row
    ]
    assert visible[1, 4].tolist() == [1, 1, 1, 1, 1, 0]


@st.composite
def layouts(draw):
    width = draw(st.integers(1, 40))
    rows = []
    for _ in range(draw(st.integers(1, 4))):
        left, lengths = width, []
        while left and draw(st.booleans()):
            n = draw(st.integers(1, left))
            lengths.append(n)
            left -= n
        rows.append(lengths)
    return positions_of(rows, width)


@settings(max_examples=60, deadline=None)
@given(layouts())
def test_mask_and_varlen_keys_equal_their_definitions(pos):
    rows, width = pos.shape
    ours = varlen_keys(pos)
    (cu_q, cu_k), (max_q, max_k) = prepare_fa_kwargs_from_position_ids(torch.from_numpy(pos))
    assert ours["cu_seq_lens_q"].dtype == np.int32 and cu_q.dtype == torch.int32
    assert ours["cu_seq_lens_q"].tolist() == cu_q.tolist()
    assert ours["cu_seq_lens_k"].tolist() == cu_k.tolist()
    assert ours["max_length_q"] == int(max_q) and ours["max_length_k"] == int(max_k)
    assert type(ours["max_length_q"]) is int
    # the mask, query by query: visible keys are exactly the causal part of its own segment
    visible = block_causal_mask(pos)[:, 0] == 0
    cu = ours["cu_seq_lens_q"].tolist()
    for r in range(rows):
        for i in range(width):
            flat = r * width + i
            start = max(a for a in cu if a <= flat) - r * width
            assert np.flatnonzero(visible[r, i]).tolist() == list(range(start, i + 1))


# ---- ShardDataset options --------------------------------------------------------------------


@pytest.fixture(scope="module")
def text_cache(tmp_path_factory, tokenizer_dir):
    folder = tmp_path_factory.mktemp("attn-corpus")
    records = [{"text": t} for t in make_texts(24, seed=4, max_words=30)]
    write_records(str(folder / "docs.jsonl"), records, "jsonl")
    out = str(tmp_path_factory.mktemp("attn-cache") / "cache")
    values = {"input": str(folder), "tokenizer": tokenizer_dir, "output": out, "workers": 1,
              "max_length": 64, "truncation": "split", "buckets": "16,32"}  # fmt: skip
    build_cache(build_options_from_mapping(values))
    return out


def test_pack_requires_an_attention_mode(text_cache):
    with pytest.raises(ConfigError, match="mode='pack' needs attention= one of mask, varlen, none"):
        ShardDataset(text_cache, 128, mode="pack", seq_len=64)
    with pytest.raises(ConfigError, match=r"attention: got 'masks'.*did you mean 'mask'"):
        ShardDataset(text_cache, 128, mode="pack", seq_len=64, attention="masks")
    with pytest.raises(ConfigError, match="applies to mode='pack' only"):
        ShardDataset(text_cache, 128, attention="mask")


@pytest.mark.parametrize("attention", ["mask", "varlen", "none"])
def test_packed_batch_keys_per_attention_mode(text_cache, attention):
    ds = ShardDataset(text_cache, 128, mode="pack", seq_len=64, attention=attention, shuffle=False)
    batch = next(iter(ds))
    model_keys = {"input_ids", "labels", "position_ids"}
    if attention == "mask":
        model_keys.add("attention_mask")
        assert batch["attention_mask"].shape == (2, 1, 64, 64)
        assert batch["attention_mask"].dtype == torch.float32
    elif attention == "varlen":
        model_keys |= {"cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"}
        assert torch.equal(batch["cu_seq_lens_q"], batch["meta"]["cu_seqlens"])
    assert set(batch) == model_keys | {"meta"}
    assert set(model_inputs(batch)) == model_keys
    assert set(batch["meta"]) == {
        "sample_ids",
        "sample_offsets",
        "cu_seqlens",
        "max_seqlen",
        "num_tokens",
    }


# ---- tiny transformers models ----------------------------------------------------------------


@pytest.fixture(scope="module", params=ARCH_IMPL, ids=lambda p: "-".join(p))
def model(request, text_cache):
    vocab = int(open_cache(text_cache).manifest["tokenizer"]["vocab_size"]) + 8
    return make_model(*request.param, vocab)


def packed_batch(cache_dir: str, attention: str):
    ds = ShardDataset(cache_dir, 128, mode="pack", seq_len=64, attention=attention, seed=1)
    batch = next(iter(ds))
    assert int((batch["meta"]["sample_ids"] >= 0).sum()) >= 4  # several documents per batch
    return batch


@torch.no_grad()
def documents_alone(model, batch):
    """(flat start, flat end, logits, loss) of every document of ``batch`` run on its own."""
    flat = batch["input_ids"].reshape(-1)
    cu = batch["meta"]["cu_seqlens"].tolist()
    out = []
    for k, sid in enumerate(batch["meta"]["sample_ids"].tolist()):
        if sid < 0:
            continue
        ids = flat[cu[k] : cu[k + 1]][None]
        # input_ids arrive as int32; torch's cross-entropy takes int64 targets only
        result = model(input_ids=ids, labels=ids.long())
        out.append((cu[k], cu[k + 1], result.logits[0], result.loss.item()))
    return out


def max_logit_error(logits, docs) -> float:
    flat = logits.reshape(-1, logits.shape[-1])
    return max((flat[a:e] - ref).abs().max().item() for a, e, ref, _ in docs)


def mean_document_loss(docs) -> float:
    """The token-weighted mean of the per-document losses (a document of n tokens has n - 1
    targets)."""
    weighted = [(loss * (e - a - 1), e - a - 1) for a, e, _, loss in docs if e - a > 1]
    return sum(w for w, _ in weighted) / sum(n for _, n in weighted)


def test_mask_mode_is_exact_with_the_default_use_cache(model, text_cache):
    batch = packed_batch(text_cache, "mask")
    docs = documents_alone(model, batch)
    out = model(**batch)
    assert torch.isfinite(out.logits).all()
    assert max_logit_error(out.logits.detach(), docs) <= ATOL
    assert out.loss.item() == pytest.approx(mean_document_loss(docs), abs=ATOL)
    out.loss.backward()  # padding never forms a fully masked query row: finite gradients
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("arch_impl", ARCH_IMPL, ids=lambda p: "-".join(p))
def test_the_float32_mask_trains_a_bf16_model(text_cache, arch_impl):
    """The float32 minimum becomes -inf in bf16: still finite, no query row is fully masked."""
    vocab = int(open_cache(text_cache).manifest["tokenizer"]["vocab_size"]) + 8
    bf16 = make_model(*arch_impl, vocab).to(torch.bfloat16)
    out = bf16(**packed_batch(text_cache, "mask"))
    assert torch.isfinite(out.logits).all() and torch.isfinite(out.loss)
    out.loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in bf16.parameters() if p.grad is not None)


@torch.no_grad()
def test_varlen_mode_is_exact_with_use_cache_false(model, text_cache):
    batch = packed_batch(text_cache, "varlen")
    (cu_q, cu_k), (max_q, max_k) = prepare_fa_kwargs_from_position_ids(batch["position_ids"])
    assert torch.equal(batch["cu_seq_lens_q"], cu_q) and torch.equal(batch["cu_seq_lens_k"], cu_k)
    assert (batch["max_length_q"], batch["max_length_k"]) == (int(max_q), int(max_k))
    docs = documents_alone(model, batch)
    out = model(**batch, use_cache=False)
    assert max_logit_error(out.logits, docs) <= ATOL
    assert out.loss.item() == pytest.approx(mean_document_loss(docs), abs=ATOL)


@torch.no_grad()
def test_position_ids_alone_leak_across_documents_under_the_default_use_cache(model, text_cache):
    """Why ``attention=`` is required: what pack mode emitted before (``"none"``) is silently
    wrong with sdpa/eager and ``use_cache=True``. If transformers ever fixes this, this test
    says so."""
    batch = packed_batch(text_cache, "none")
    docs = documents_alone(model, batch)
    assert max_logit_error(model(**batch).logits, docs) > 1e-2
    assert max_logit_error(model(**batch, use_cache=False).logits, docs) <= ATOL


@torch.no_grad()
def test_pad_batches_are_exact(model, text_cache):
    batch = next(iter(ShardDataset(text_cache, 256, seed=2)))
    out = model(**batch)
    mask = batch["attention_mask"]
    assert (mask == 0).any()  # padding is present
    for row in range(len(mask)):
        n = int(mask[row].sum())
        alone = model(input_ids=batch["input_ids"][row : row + 1, :n]).logits[0]
        assert (out.logits[row, :n] - alone).abs().max().item() <= ATOL


# ---- chat caches: labels follow the stored masks in every mode --------------------------------


@pytest.fixture(scope="module")
def chat_cache(tmp_path_factory, chatml_tokenizer_dir):
    folder = tmp_path_factory.mktemp("attn-chat")
    records = [{"messages": m} for m in make_conversations(30, seed=1)]
    write_records(str(folder / "a.jsonl"), records, "jsonl")
    out = str(tmp_path_factory.mktemp("attn-chat-cache") / "cache")
    values = {"input": str(folder), "tokenizer": chatml_tokenizer_dir, "output": out,
              "workers": 1, "chat": True, "max_length": 128}  # fmt: skip
    build_cache(build_options_from_mapping(values))
    return out


@pytest.mark.parametrize("attention", ["mask", "varlen", "none"])
@pytest.mark.parametrize("packing", ["best_fit", "concat"])
def test_chat_labels_follow_the_masks(attention, packing, chat_cache):
    path = chat_cache
    cache = open_cache(path)
    seq_len = 128 if packing == "best_fit" else 64
    ds = ShardDataset(path, 1024, mode="pack", seq_len=seq_len, packing=packing,
                      attention=attention)  # fmt: skip
    checked = 0
    for batch in ds:
        ids, labels = batch["input_ids"].reshape(-1), batch["labels"].reshape(-1)
        meta = batch["meta"]
        cu = meta["cu_seqlens"].tolist()
        for k, (sid, offset) in enumerate(
            zip(meta["sample_ids"].tolist(), meta["sample_offsets"].tolist())
        ):
            a, e = cu[k], cu[k + 1]
            if sid < 0:
                assert torch.all(labels[a:e] == -100)
                continue
            mask = cache.read_masks(np.array([sid]))[0][offset : offset + e - a]
            want = np.where(mask, ids[a:e].numpy(), -100)
            want[0] = -100  # a segment's first token is never a target
            assert labels[a:e].tolist() == want.tolist()
            checked += 1
    assert checked >= cache.num_sequences


def test_positions_must_be_two_dimensional():
    with pytest.raises(ConfigError, match=r"position_ids: got shape \(4,\), expected a 2-D"):
        block_causal_mask(np.arange(4))


def test_chat_labels_follow_the_masks_in_pad_mode(chat_cache):
    """Pad batches are gathered straight into padded rows, masks included."""
    cache = open_cache(chat_cache)
    seen = 0
    for batch in ShardDataset(chat_cache, 1024, seed=2):
        ids, labels, attn = batch["input_ids"], batch["labels"], batch["attention_mask"]
        for row, sid in enumerate(batch["meta"]["sample_ids"].tolist()):
            stored = cache.read(sid)
            n = len(stored)
            assert ids[row, :n].tolist() == stored.tolist()
            assert attn[row].tolist() == [1] * n + [0] * (ids.shape[1] - n)
            mask = cache.read_masks(np.array([sid]))[0]
            want = np.where(mask, stored.astype(np.int64), -100).tolist()
            assert labels[row].tolist() == want + [-100] * (ids.shape[1] - n)
            seen += 1
    assert seen == cache.num_sequences
