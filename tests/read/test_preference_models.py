"""Preference batches through tiny random Qwen2 and Llama models (CPU, sdpa and eager): the
per-sequence completion log-prob sums over a packed (or padded) pair batch, by ``pair_logps``,
equal those of every sequence run alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import make_model
from shardcache import ConfigError, ShardDataset, model_inputs, open_cache, pair_logps

ATOL = 1e-4
ARCH_IMPL = [(a, i) for a in ("qwen2", "llama") for i in ("sdpa", "eager")]
SEQ_LEN = 64


@pytest.fixture(scope="module", params=ARCH_IMPL, ids=lambda p: "-".join(p))
def model(request, pairs_cache):
    vocab = int(open_cache(pairs_cache).manifest["tokenizer"]["vocab_size"]) + 8
    return make_model(*request.param, vocab)


@torch.no_grad()
def logps_alone(model, cache, sample: int) -> float:
    """The completion's summed log-probs of one stored sequence, run alone (float64 sum)."""
    ids = torch.from_numpy(cache.read(sample).astype(np.int64))[None]
    trainable = torch.from_numpy(cache.read_masks(np.array([sample]))[0])
    logps = model(input_ids=ids).logits[0, :-1].double().log_softmax(-1)
    picked = logps.gather(-1, ids[0, 1:, None])[:, 0]
    assert trainable[1:].any()
    return float(picked[trainable[1:]].sum())


def assert_pairs_alone(model, cache, batch, chosen, rejected) -> int:
    meta = batch["meta"]
    pairs = meta["pair_ids"][meta["side"] == 0].tolist()
    assert chosen.dtype == rejected.dtype == torch.float32
    assert len(chosen) == len(rejected) == len(pairs) >= 4
    for k, pair in enumerate(pairs):
        assert abs(float(chosen[k]) - logps_alone(model, cache, 2 * pair)) <= ATOL
        assert abs(float(rejected[k]) - logps_alone(model, cache, 2 * pair + 1)) <= ATOL
    return len(pairs)


@pytest.mark.parametrize("attention", ["mask", "varlen"])
@torch.no_grad()
def test_packed_pairs_equal_each_sequence_alone(model, pairs_cache, attention):
    ds = ShardDataset(pairs_cache, 3 * SEQ_LEN, mode="pack", seq_len=SEQ_LEN, attention=attention,
                      seed=1, streams=0)  # fmt: skip
    batch = next(iter(ds))
    assert (batch["meta"]["sample_ids"] < 0).any()  # rows end in padding
    # "mask" is exact under the default use_cache; "varlen" with sdpa/eager needs it off
    extra = {} if attention == "mask" else {"use_cache": False}
    logits = model(**model_inputs(batch), **extra).logits
    chosen, rejected = pair_logps(logits, batch)
    assert_pairs_alone(model, open_cache(pairs_cache), batch, chosen, rejected)


@torch.no_grad()
def test_padded_pairs_equal_each_sequence_alone(model, pairs_cache):
    batch = next(iter(ShardDataset(pairs_cache, 256, seed=2, streams=0)))
    assert (batch["attention_mask"] == 0).any()
    chosen, rejected = pair_logps(model(**model_inputs(batch)).logits, batch)
    assert_pairs_alone(model, open_cache(pairs_cache), batch, chosen, rejected)


def test_sums_are_each_segments_completion_targets(pairs_cache):
    """Every sum is over its own segment's labelled targets: no padding, no neighbour."""
    ds = ShardDataset(pairs_cache, 3 * SEQ_LEN, mode="pack", seq_len=SEQ_LEN, attention="none",
                      seed=1, streams=0)  # fmt: skip
    batch = next(iter(ds))
    vocab = int(open_cache(pairs_cache).manifest["tokenizer"]["vocab_size"])
    logits = torch.randn(
        *batch["input_ids"].shape, vocab, generator=torch.Generator().manual_seed(0)
    )
    chosen, rejected = pair_logps(logits, batch)
    flat = logits.reshape(-1, logits.shape[-1]).double().log_softmax(-1)
    labels = batch["labels"].reshape(-1)
    cu = batch["meta"]["cu_seqlens"].tolist()
    sums = []
    for k, sid in enumerate(batch["meta"]["sample_ids"].tolist()):
        total = 0.0
        for t in range(cu[k] + 1, cu[k + 1]):
            if labels[t] != -100:
                total += float(flat[t - 1, labels[t]])
        sums.append((sid, total))
    want = [s for sid, s in sums if sid >= 0]
    got = torch.stack([chosen, rejected], 1).reshape(-1).tolist()
    assert got == pytest.approx(want, abs=1e-4)


def test_a_batch_without_pairs_is_refused(pairs_cache, tokenizer_dir):
    batch = {"labels": torch.zeros(2, 4, dtype=torch.int64), "meta": {"sample_ids": None}}
    with pytest.raises(ConfigError, match="preference cache"):
        pair_logps(torch.zeros(2, 4, 8), batch)
    pad = next(iter(ShardDataset(pairs_cache, 256, seed=2, streams=0)))
    with pytest.raises(ConfigError, match="logits of shape"):
        pair_logps(torch.zeros(1, 2, 8), pad)


@pytest.mark.parametrize("mode", ["pad", "pack"])
def test_sums_hold_their_documented_tolerance_at_qwens_vocabulary(mode):
    """At Qwen's 151,646 ids and sums of thousands, each value is within one float32 ulp of its
    sum (``2**-23 * |sum|``) of a float64 reference over the same float32 logits: the tokens'
    log-probs are accumulated in float64 (a float32 ``index_add_`` was 2-4 ulps off)."""
    vocab, rows, width = 151_646, 4, 256
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(rows, width, vocab, generator=gen) * 4
    ids = torch.randint(0, vocab, (rows, width), generator=gen)
    labels = ids.clone()
    labels[:, :8] = -100  # the prompt, and each sequence's first token
    side = torch.tensor([0, 1, 0, 1])
    meta = {"side": side, "pair_ids": torch.tensor([0, 0, 1, 1])}
    if mode == "pack":  # the same rows as one segment each of a packed batch
        meta["cu_seqlens"] = torch.arange(rows + 1, dtype=torch.int32) * width
    chosen, rejected = pair_logps(logits, {"input_ids": ids, "labels": labels, "meta": meta})
    got = torch.stack([chosen, rejected], 1).flatten().double()
    want = torch.empty(rows, dtype=torch.float64)
    for row in range(rows):  # one row at a time: a float64 copy of all of them is 1.2 GB
        wide = logits[row, :-1].double()
        target = labels[row, 1:]
        picked = wide.gather(-1, target.clamp(min=0)[:, None])[:, 0] - wide.logsumexp(-1)
        want[row] = picked[target != -100].sum()
    assert (want.abs() > 4000).all()
    ulp = torch.finfo(torch.float32).eps * want.abs()
    assert ((got - want).abs() <= ulp).all(), ((got - want).abs() / ulp).tolist()
