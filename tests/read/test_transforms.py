"""The built-in read-time transforms ``FIM`` and ``SpanMask`` (issue 46)."""

from __future__ import annotations

import collections
import dataclasses
import json
import pathlib
import pickle
import re

import numpy as np
import pytest

from shardcache import (
    FIM,
    ConfigError,
    PlanOptions,
    ShardDataset,
    Source,
    SpanMask,
    Split,
    StateError,
    open_cache,
)
from tests.conftest import (
    _save_bpe,
    assert_resumable,
    make_conversations,
    make_texts,
    write_records,
)

SENTINELS = ("<fim_prefix>", "<fim_middle>", "<fim_suffix>")


@pytest.fixture(scope="module")
def fim_tokenizer(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("tok-fim"))
    return _save_bpe(folder, make_texts(200, seed=2), 500, bos=False,
                     extra_specials=(*SENTINELS, "<mask>"))  # fmt: skip


@pytest.fixture(scope="module")
def ids_of(fim_tokenizer):
    with open(f"{fim_tokenizer}/tokenizer.json") as f:
        return {t["content"]: t["id"] for t in json.load(f)["added_tokens"]}


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory, fim_tokenizer):
    from shardcache.builder.run import build_cache
    from shardcache.config import build_options_from_mapping

    folder = tmp_path_factory.mktemp("fim-corpus")
    rng = np.random.default_rng(0)
    words = ["def", "return", "x", "=", "(", ")", "if", "else", "for", "in", "range", "print"]
    with open(folder / "code.jsonl", "w") as out:
        for d in range(6000):
            n = int(rng.integers(4, 30))
            out.write(json.dumps({"text": " ".join(rng.choice(words, n)) + f" # {d}"}) + "\n")
    path = str(tmp_path_factory.mktemp("fim-cache") / "cache")
    values = {"input": str(folder), "tokenizer": fim_tokenizer, "output": path, "workers": 1,
              "max_length": 64, "shard_size": 65536}  # fmt: skip
    build_cache(build_options_from_mapping(values))
    return path


def _sequences(count, seed=0, low=4, high=200):
    rng = np.random.default_rng(seed)
    for i in range(count):
        n = int(rng.integers(low, high))
        # ids 10..399: never a sentinel (500..503 in these tests)
        yield rng.integers(10, 400, n).astype(np.uint32), np.random.default_rng([seed, i])


FIM_IDS = (500, 501, 502)


@pytest.mark.parametrize("spm_rate", [0.0, 0.5, 1.0])
def test_fim_keeps_the_length_and_the_tokens_but_the_dropped_tail(spm_rate):
    fim = FIM(0.5, *FIM_IDS, spm_rate=spm_rate, keep_length=True)
    assert fim.max_growth == 0
    applied = 0
    for ids, rng in _sequences(500):
        out, mask = fim(ids.copy(), None, rng)
        assert out.shape == ids.shape and out.dtype == ids.dtype and mask is None
        sentinel = np.isin(out, FIM_IDS)
        if sentinel.any():  # sentinels exactly when applied: once each
            applied += 1
            assert sorted(out[sentinel].tolist()) == sorted(FIM_IDS)
            assert out[0] == FIM_IDS[0]
            # the rest is the sequence without its last 3 tokens, rearranged
            assert sorted(out[~sentinel].tolist()) == sorted(ids[:-3].tolist())
        else:
            assert np.array_equal(out, ids)
    assert 200 < applied < 300


def test_fim_orders_psm_and_spm():
    ids = np.arange(10, 30, dtype=np.int32)
    _, mid, suf = FIM_IDS
    for spm_rate in (0.0, 1.0):
        fim = FIM(1.0, *FIM_IDS, spm_rate=spm_rate, keep_length=True)
        out, _ = fim(ids.copy(), None, np.random.default_rng(3))
        i_suf, i_mid = int(np.flatnonzero(out == suf)[0]), int(np.flatnonzero(out == mid)[0])
        if spm_rate == 0.0:  # <pre> prefix <suf> suffix <mid> middle
            prefix, suffix, middle = out[1:i_suf], out[i_suf + 1 : i_mid], out[i_mid + 1 :]
        else:  # <pre> <suf> suffix <mid> prefix middle: prefix+middle is contiguous
            assert i_suf == 1
            suffix, prefix, middle = out[2:i_mid], out[i_mid + 1 :], np.array([], np.int32)
        body = np.concatenate([prefix, middle, suffix])
        assert np.array_equal(body, ids[:-3])  # the three parts, back in order


@pytest.mark.parametrize("keep_length", [True, False])
def test_fim_rate_over_many_sequences_is_within_one_percent(keep_length):
    for rate in (0.1, 0.5, 0.9):
        fim = FIM(rate, *FIM_IDS, keep_length=keep_length)
        hits = [fim(ids, None, rng)[0][0] == FIM_IDS[0] for ids, rng in _sequences(20000, 1)]
        assert abs(np.mean(hits) - rate) < 0.01


def test_fim_leaves_sequences_too_short_for_the_sentinels():
    fim = FIM(1.0, *FIM_IDS, keep_length=True)
    for n in range(4):
        ids = np.arange(n, dtype=np.int64)
        assert np.array_equal(fim(ids.copy(), None, np.random.default_rng(0))[0], ids)
    out, _ = fim(np.arange(4, dtype=np.int64), None, np.random.default_rng(0))
    assert np.isin(out, FIM_IDS).sum() == 3
    # the growing form rewrites any sequence of a token or more
    grow = FIM(1.0, *FIM_IDS)
    assert len(grow(np.zeros(0, np.int64), None, np.random.default_rng(0))[0]) == 0
    out, _ = grow(np.array([42]), None, np.random.default_rng(0))
    assert sorted(out.tolist()) == sorted([42, *FIM_IDS]) and out[0] == FIM_IDS[0]


@pytest.mark.parametrize("keep_length", [True, False])
def test_fim_moves_the_loss_mask_with_its_tokens_and_masks_the_sentinels(keep_length):
    fim = FIM(1.0, *FIM_IDS, spm_rate=0.5, keep_length=keep_length, split_token=7)
    for ids, rng in _sequences(200, 2):
        ids[::9] = 7  # fragments
        mask = (ids % 2).astype(bool)  # odd ids trainable: the mask follows each token
        out, new_mask = fim(ids.copy(), mask.copy(), rng)
        sentinel = np.isin(out, FIM_IDS)
        assert not new_mask[sentinel].any()
        assert np.array_equal(new_mask[~sentinel], (out[~sentinel] % 2).astype(bool))


def test_fim_is_deterministic_for_the_same_rng_and_picklable():
    fim = pickle.loads(pickle.dumps(FIM(0.7, *FIM_IDS, spm_rate=0.3)))
    for ids, _ in _sequences(50, 4):
        a = fim(ids.copy(), None, np.random.default_rng(7))[0]
        b = fim(ids.copy(), None, np.random.default_rng(7))[0]
        assert np.array_equal(a, b)


def test_fim_checks_its_sentinels(fim_tokenizer, ids_of, tmp_path):
    with pytest.raises(ConfigError, match=r"prefix_id.*middle_id.*suffix_id"):
        FIM(0.5, 5, 5, 6)
    with pytest.raises(ConfigError, match="FIM middle_id: got -1"):
        FIM(0.5, 5, -1, 6)
    with pytest.raises(ConfigError, match=r"FIM rate: got 1\.5"):
        FIM(1.5, 5, 6, 7)
    with pytest.raises(ConfigError, match="spm_rate"):
        FIM(0.5, 5, 6, 7, spm_rate=-0.1)
    fim = FIM.from_tokenizer(fim_tokenizer, 0.5)
    assert (fim.prefix_id, fim.middle_id, fim.suffix_id) == tuple(ids_of[s] for s in SENTINELS)
    assert FIM.from_tokenizer(f"{fim_tokenizer}/tokenizer.json", 0.5) == fim
    # StarCoder's spellings
    data = json.loads(pathlib.Path(fim_tokenizer, "tokenizer.json").read_text())
    for t in data["added_tokens"]:
        t["content"] = t["content"].replace("<fim_", "<|fim_").replace(">", "|>")
    starcoder = tmp_path / "tokenizer.json"
    starcoder.write_text(json.dumps(data))
    assert FIM.from_tokenizer(starcoder, 0.5) == fim
    # no sentinels: the names looked for
    data["added_tokens"] = [t for t in data["added_tokens"] if "fim_middle" not in t["content"]]
    starcoder.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=r"<fim_prefix>.*<\|fim_suffix\|>"):
        FIM.from_tokenizer(starcoder, 0.5)
    with pytest.raises(ConfigError, match="cannot read"):
        FIM.from_tokenizer(tmp_path / "missing", 0.5)
    # ids a uint16 cache cannot hold
    with pytest.raises(ConfigError, match="do not fit"):
        FIM(1.0, 70000, 1, 2)(np.arange(10, dtype=np.uint16), None, np.random.default_rng(0))


def _key(batch):
    return tuple(batch["meta"]["sample_ids"].tolist()), tuple(batch["input_ids"].flatten().tolist())


@pytest.mark.parametrize("keep_length", [True, False])
def test_fim_through_shard_dataset_resumes_exactly_and_keeps_its_rate(
    cache_dir, fim_tokenizer, keep_length
):
    fim = FIM.from_tokenizer(fim_tokenizer, 0.5, 0.5, keep_length=keep_length)

    def make():
        return ShardDataset(cache_dir, 1024, seed=4, transform=fim)

    full = assert_resumable(make, lambda ds: iter(ds), _key, steps=[0, 5, 40])
    plain = [_key(b) for b in ShardDataset(cache_dir, 1024, seed=4)]
    if keep_length:
        assert [k[0] for k in full] == [k[0] for k in plain]  # the same plan, other tokens
    else:  # 3 tokens reserved a sequence: fewer rows a batch, the same sequences
        assert make().options.growth == 3 and len(full) > len(plain)
        assert sorted(i for k in full for i in k[0]) == sorted(i for k in plain for i in k[0])
    # the rate over epochs, counted on the sequences long enough for the sentinels
    with open_cache(cache_dir) as cache:
        long_enough = cache.lengths >= (4 if keep_length else 1)
    applied = eligible = 0
    for epoch in range(3):
        ds = make()
        ds.set_epoch(epoch)
        for batch in ds:
            ids = batch["meta"]["sample_ids"].numpy()
            rows = ids >= 0
            applied += int((batch["input_ids"][rows] == fim.prefix_id).any(dim=1).sum())
            eligible += int(long_enough[ids[rows]].sum())
    assert eligible > 15000
    assert abs(applied / eligible - 0.5) < 0.01


def _unfim(out, prefix, middle, suffix):
    """The fragment a rewritten one came from, and whether it was in SPM order."""
    out = list(out)
    i_suf, i_mid = out.index(suffix), out.index(middle)
    assert out[0] == prefix and out.count(prefix) == out.count(suffix) == out.count(middle) == 1
    if i_suf == 1:  # SPM: <pre> <suf> suffix <mid> prefix+middle (or PSM with no prefix)
        return out[i_mid + 1 :] + out[2:i_mid], True
    return out[1:i_suf] + out[i_mid + 1 :] + out[i_suf + 1 : i_mid], False


def test_fim_grows_by_the_sentinels_and_keeps_every_token():
    fim = FIM(0.5, *FIM_IDS, spm_rate=0.5)
    assert fim.max_growth == 3 and fim.keeps_mask
    grown = 0
    for ids, rng in _sequences(500, 6):
        out, _ = fim(ids.copy(), None, rng)
        if len(out) == len(ids):
            assert np.array_equal(out, ids)
            continue
        grown += 1
        assert len(out) == len(ids) + 3 and out.dtype == ids.dtype
        assert _unfim(out.tolist(), *FIM_IDS)[0] == ids.tolist()  # every token, rearranged
    assert 200 < grown < 300


def _fragmented(count, seed, split=7):
    """Sequences of 1 to 8 fragments of 20..120 ids, ``split`` between them."""
    rng = np.random.default_rng(seed)
    for i in range(count):
        parts = [
            rng.integers(10, 400, int(rng.integers(20, 120))) for _ in range(rng.integers(1, 9))
        ]
        glued = [x for p in parts for x in (*p.tolist(), split)][:-1]
        yield parts, np.array(glued, np.uint16), np.random.default_rng([seed, i])


def test_fim_rewrites_each_fragment_at_its_rate_in_psm_and_spm():
    fim = FIM(0.5, *FIM_IDS, spm_rate=0.3, split_token=7, max_fragments=8)
    assert fim.max_growth == 24
    fragments = rewritten = spm = 0
    for parts, ids, rng in _fragmented(4000, 1):
        out, _ = fim(ids, None, rng)
        pieces = np.split(out, np.flatnonzero(out == 7))
        pieces = [p[1:] if k else p for k, p in enumerate(pieces)]  # (the split token first)
        assert len(pieces) == len(parts)  # the split tokens stay, one between two fragments
        for piece, part in zip(pieces, parts):
            fragments += 1
            if np.array_equal(piece, part):
                continue
            original, in_spm = _unfim(piece.tolist(), *FIM_IDS)
            assert original == part.tolist()
            rewritten += 1
            spm += in_spm
        assert len(out) == len(ids) + 3 * (np.isin(out, FIM_IDS[0]).sum())
    assert fragments > 15000
    assert abs(rewritten / fragments - 0.5) < 0.01
    assert abs(spm / rewritten - 0.3) < 0.02  # (a PSM with no prefix reads as SPM too)


def test_fim_grows_at_most_max_fragments_then_keeps_the_length():
    fim = FIM(1.0, *FIM_IDS, split_token=7, max_fragments=2)
    assert fim.max_growth == 6
    for parts, ids, rng in _fragmented(300, 2):
        out, _ = fim(ids, None, rng)
        assert len(out) == len(ids) + 3 * min(len(parts), 2)
        assert np.isin(out, FIM_IDS[0]).sum() == len(parts)  # every fragment rewritten
    keep = FIM(1.0, *FIM_IDS, split_token=7, keep_length=True)
    for parts, ids, rng in _fragmented(100, 3):
        out, _ = keep(ids, None, rng)
        assert len(out) == len(ids) and np.isin(out, FIM_IDS[0]).sum() == len(parts)


def test_fim_checks_its_split_options(fim_tokenizer, ids_of):
    with pytest.raises(ConfigError, match="must differ"):
        FIM(0.5, 5, 6, 7, split_token=6)
    with pytest.raises(ConfigError, match="split_token: got -2"):
        FIM(0.5, 5, 6, 7, split_token=-2)
    with pytest.raises(ConfigError, match=r"max_fragments.*needs a split_token"):
        FIM(0.5, 5, 6, 7, max_fragments=3)
    with pytest.raises(ConfigError, match="max_fragments: got 0"):
        FIM(0.5, 5, 6, 7, split_token=8, max_fragments=0)
    fim = FIM.from_tokenizer(fim_tokenizer, 0.5, split_token="<mask>", max_fragments=4)
    assert fim.split_token == ids_of["<mask>"] and fim.max_growth == 12
    with pytest.raises(ConfigError, match="split_token '<sep>' is not among"):
        FIM.from_tokenizer(fim_tokenizer, 0.5, split_token="<sep>")


def test_span_mask_masks_its_rate_in_spans_and_keeps_the_rest():
    mask_id = 503
    for rate, mean_span in ((0.15, 3), (0.5, 1), (1.0, 5)):
        sm = SpanMask(rate, mask_id, mean_span)
        for ids, rng in _sequences(300, 5):
            loss = (ids % 2).astype(bool)
            out, new_loss = sm(ids.copy(), loss.copy(), rng)
            hit = out == mask_id
            assert out.shape == ids.shape and hit.sum() == round(len(ids) * rate)
            assert np.array_equal(out[~hit], ids[~hit])
            assert np.array_equal(new_loss, loss & ~hit)
            spans = int(np.sum(np.diff(hit.astype(np.int8), prepend=0) == 1))
            assert spans <= max(1, round(hit.sum() / mean_span))  # touching spans merge
        a = sm(ids.copy(), None, np.random.default_rng(1))[0]
        assert np.array_equal(a, sm(ids.copy(), None, np.random.default_rng(1))[0])
    with pytest.raises(ConfigError, match="mean_span"):
        SpanMask(0.1, 3, mean_span=0.5)
    with pytest.raises(ConfigError, match="SpanMask rate"):
        SpanMask(-0.1, 3)


def test_span_mask_through_shard_dataset_resumes_exactly(cache_dir, ids_of):
    sm = SpanMask(0.2, ids_of["<mask>"])
    full = assert_resumable(
        lambda: ShardDataset(cache_dir, 1024, seed=5, transform=sm), iter, _key, steps=[0, 7]
    )
    assert any(ids_of["<mask>"] in k[1] for k in full)


def _stamp(ids, mask, rng):
    """Overwrite every token with real ids drawn by ``rng``: the output shows which one ran."""
    return rng.integers(10, 400, len(ids)).astype(ids.dtype), mask


@pytest.mark.parametrize(("streams", "side"), [(0, None), (3, None), (0, "train")])
def test_a_repeated_document_gets_its_own_randomness_per_repetition(cache_dir, streams, side):
    # one source used 2.5 times per epoch: every document (of the side) twice or three times
    # (two whole passes and a window), each copy its own generator
    def make():
        source = Source(cache_dir, max_repetitions=2.5)
        split = {} if side is None else {"split": side, "splits": Split(validation=0.3)}
        return ShardDataset([source], 1024, seed=1, transform=_stamp, streams=streams,
                            shuffle_block=2048, **split)  # fmt: skip

    copies = collections.defaultdict(list)
    for batch in make():
        ids, width = batch["meta"]["sample_ids"].tolist(), batch["attention_mask"].sum(dim=1)
        for row, (sample, n) in enumerate(zip(ids, width.tolist())):
            copies[sample].append(tuple(batch["input_ids"][row, :n].tolist()))
    assert len(copies) > (3500 if side else 5000) and {len(c) for c in copies.values()} == {2, 3}
    assert all(len(set(c)) == len(c) for c in copies.values())
    assert_resumable(make, iter, _key, steps=[3])


# ---- transforms that lengthen a sequence: the plan reserves their growth ---------------------


@dataclasses.dataclass(frozen=True)
class Grow:
    """Insert exactly ``max_growth`` random tokens at random places (inserted: not trainable)."""

    max_growth: int

    def __call__(self, ids, mask, rng):
        at = np.sort(rng.integers(0, len(ids) + 1, self.max_growth))
        out = np.insert(ids, at, rng.integers(10, 400, self.max_growth).astype(ids.dtype))
        return out, None if mask is None else np.insert(mask, at, False)


@pytest.mark.parametrize("streams", [0, 3])
@pytest.mark.parametrize("mode", ["pad", "pack", "concat"])
def test_a_lengthening_transform_never_exceeds_the_budget(cache_dir, mode, streams):
    growth, budget = 5, 300  # sequences of up to 64 tokens: rows of up to 69 once grown
    extra = {
        "pad": {},
        "pack": {"mode": "pack", "seq_len": 69, "attention": "none"},
        "concat": {"mode": "pack", "seq_len": 50, "packing": "concat", "attention": "none"},
    }[mode]
    ds = ShardDataset(cache_dir, budget, seed=3, transform=Grow(growth), streams=streams,
                      shuffle_block=2048, **extra)  # fmt: skip
    assert ds.options.growth == growth and ds.state_dict()["plan"]["growth"] == growth
    with open_cache(cache_dir) as cache:
        lengths = np.asarray(cache.lengths, dtype=np.int64)
    tokens = collections.Counter()
    for batch in ds:
        assert batch["input_ids"].numel() <= budget
        meta = batch["meta"]
        ids = meta["sample_ids"].numpy()
        if mode == "pad":
            got = batch["attention_mask"].sum(dim=1).numpy()
        else:  # a segment never crosses its row (its positions restart at 0 inside the row)
            got = np.diff(meta["cu_seqlens"].numpy())[ids >= 0]
            ids = ids[ids >= 0]
            assert int(batch["position_ids"].max()) < extra["seq_len"]
        for i, n in zip(ids.tolist(), got.tolist()):
            tokens[i] += n
    # every sequence grew by all of it (concat: over the pieces the rows hold)
    if streams == 0:
        assert sorted(tokens) == list(range(len(lengths)))
        assert all(n == lengths[i] + growth for i, n in tokens.items())
    else:  # (the streams even out by dropping a few batches: a piece may be missing)
        assert len(tokens) > 0.95 * len(lengths)
        assert all(n <= lengths[i] + growth for i, n in tokens.items())
        assert sum(n == lengths[i] + growth for i, n in tokens.items()) > 0.95 * len(lengths)


def test_concat_pieces_of_a_document_that_grew_less_than_planned_are_padded(cache_dir):
    ds = ShardDataset(cache_dir, 300, seed=3, transform=_Claims(5, 2), mode="pack", seq_len=50,
                      packing="concat", attention="none", streams=0)  # fmt: skip
    with open_cache(cache_dir) as cache:
        lengths = np.asarray(cache.lengths, dtype=np.int64)
    pads, tokens = collections.Counter(), collections.Counter()
    for batch in ds:
        meta = batch["meta"]
        cu, ids = meta["cu_seqlens"].tolist(), meta["sample_ids"].tolist()
        flat, labels = batch["input_ids"].reshape(-1), batch["labels"].reshape(-1)
        for k, i in enumerate(ids):
            if i >= 0:
                piece = flat[cu[k] : cu[k + 1]]
                pad = piece == ds.pad_id
                assert (labels[cu[k] : cu[k + 1]][pad] == -100).all()  # padding is never a target
                pads[i] += int(pad.sum())
                tokens[i] += len(piece)
    assert all(tokens[i] == lengths[i] + 5 and pads[i] == 3 for i in range(len(lengths)))


def _grow_undeclared(ids, mask, rng):
    return np.append(ids, ids[:2]), mask


def test_a_transform_growing_more_than_it_declared_is_refused(cache_dir):
    with pytest.raises(ConfigError, match=r"max_growth=0.*1 to \d+ tokens.*declare a larger"):
        next(iter(ShardDataset(cache_dir, 1024, transform=_grow_undeclared)))
    with pytest.raises(ConfigError, match=r"max_growth=1.*1 to"):
        next(iter(ShardDataset(cache_dir, 1024, transform=_Claims(1, 2))))
    with pytest.raises(ConfigError, match="max_growth=-1"):
        ShardDataset(cache_dir, 1024, transform=_Claims(-1, 0))
    with pytest.raises(ConfigError, match="growth: got -1"):
        PlanOptions(max_tokens=64, growth=-1)
    # a growth given in the options and a transform's: the larger is reserved
    given = PlanOptions(max_tokens=1024, growth=7)
    assert ShardDataset(cache_dir, options=given, transform=Grow(3)).options.growth == 7
    assert ShardDataset(cache_dir, 1024, transform=Grow(3), growth=1).options.growth == 3
    with pytest.raises(ConfigError, match=r"growth: 3 with packing='concat' but no transform"):
        ShardDataset(cache_dir, 1024, mode="pack", seq_len=64, packing="concat",
                     attention="none", growth=3)  # fmt: skip
    # a length-keeping transform packs with concat as before, piece by piece
    ds = ShardDataset(cache_dir, 1024, mode="pack", seq_len=64, packing="concat",
                      attention="none", transform=Grow(0))  # fmt: skip
    assert ds.options.growth == 0 and next(iter(ds))["input_ids"].shape == (16, 64)


@dataclasses.dataclass(frozen=True)
class _Claims:
    """Declares ``max_growth`` but adds ``adds`` tokens."""

    max_growth: int
    adds: int

    def __call__(self, ids, mask, rng):
        return np.append(ids, np.full(self.adds, 11, ids.dtype)), mask


def test_the_reserved_growth_is_part_of_the_plan_a_state_resumes(cache_dir):
    def make(growth):
        return ShardDataset(cache_dir, 512, seed=2, transform=Grow(growth))

    ds = make(3)
    it = iter(ds)
    next(it)
    state = json.loads(json.dumps(ds.state_dict(steps=1)))
    with pytest.raises(StateError, match="growth: 3 -> 5"):
        make(5).load_state_dict(state)
    full = assert_resumable(lambda: make(3), iter, _key, steps=[4])
    assert len(full) > len(list(ShardDataset(cache_dir, 512, seed=2)))  # fewer rows a batch
    # a state of a version without ``growth`` (nor a run record) is a state without growth
    del state["plan"]["growth"], state["run"]
    ShardDataset(cache_dir, 512, seed=2).load_state_dict(state)


@pytest.fixture(scope="module")
def chat_cache(tmp_path_factory, chatml_tokenizer_dir):
    from shardcache.builder.run import build_cache
    from shardcache.config import build_options_from_mapping

    folder = tmp_path_factory.mktemp("xform-chat")
    records = [{"messages": m} for m in make_conversations(30, seed=1)]
    write_records(str(folder / "a.jsonl"), records, "jsonl")
    out = str(tmp_path_factory.mktemp("xform-chat-cache") / "cache")
    values = {"input": str(folder), "tokenizer": chatml_tokenizer_dir, "output": out,
              "workers": 1, "chat": True, "max_length": 128}  # fmt: skip
    build_cache(build_options_from_mapping(values))
    return out


@dataclasses.dataclass(frozen=True)
class _Prepend:
    """Put ``max_growth`` copies of token 7 first, untrained; ``keeps_mask`` as told."""

    max_growth: int
    keeps_mask: bool = True
    drop_mask: bool = False

    def __call__(self, ids, mask, rng):
        out = np.concatenate([np.full(self.max_growth, 7, ids.dtype), ids])
        if mask is None or self.drop_mask:
            return out, None
        return out, np.concatenate([np.zeros(self.max_growth, bool), mask])


@pytest.mark.parametrize("mode", ["pad", "pack"])
def test_a_lengthening_transform_carries_chat_loss_masks(chat_cache, mode):
    extra = {} if mode == "pad" else {"mode": "pack", "seq_len": 131, "attention": "none"}
    cache = open_cache(chat_cache)
    seen = 0
    for batch in ShardDataset(chat_cache, 1024, seed=2, transform=_Prepend(3), **extra):
        ids, labels = batch["input_ids"], batch["labels"]
        meta = batch["meta"]
        if mode == "pad":
            spans = [(r, 0, int(n)) for r, n in enumerate(batch["attention_mask"].sum(dim=1))]
        else:
            cu = meta["cu_seqlens"].tolist()
            ids, labels = ids.reshape(1, -1), labels.reshape(1, -1)
            spans = [(0, cu[k], cu[k + 1] - cu[k]) for k in range(len(cu) - 1)]
        for (row, at, n), sid in zip(spans, meta["sample_ids"].tolist()):
            if sid < 0:
                continue
            stored = cache.read(sid)
            mask = cache.read_masks(np.array([sid]))[0]
            assert n == len(stored) + 3
            assert ids[row, at : at + n].tolist() == [7, 7, 7, *stored.tolist()]
            want = [-100] * 3 + np.where(mask, stored.astype(np.int64), -100).tolist()
            assert labels[row, at : at + n].tolist() == want
            seen += 1
    assert seen == cache.num_sequences
    cache.close()
    with pytest.raises(ConfigError, match=r"keeps_mask=False.*chat cache"):
        ShardDataset(chat_cache, 1024, transform=_Prepend(3, keeps_mask=False))
    with pytest.raises(ConfigError, match=r"no loss mask.*chat cache"):
        next(iter(ShardDataset(chat_cache, 1024, transform=_Prepend(3, drop_mask=True))))


def test_sentinel_ids_are_checked_against_the_caches_tokenizer_at_start(cache_dir, ids_of):
    with open_cache(cache_dir) as cache:
        largest = int(cache.manifest["tokenizer"]["max_token_id"])
    with pytest.raises(ConfigError, match=rf"FIM: token ids \{{'suffix_id': {largest + 1}\}}"):
        ShardDataset(cache_dir, 1024, transform=FIM(0.5, 1, 2, largest + 1))
    with pytest.raises(ConfigError, match=r"SpanMask: .* past the largest id"):
        ShardDataset(cache_dir, 1024, transform=SpanMask(0.1, 70000))
    with pytest.raises(ConfigError, match="split_token"):
        ShardDataset(cache_dir, 1024, transform=FIM(0.5, 1, 2, 3, split_token=largest + 5))
    ShardDataset(cache_dir, 1024, transform=FIM(0.5, 1, 2, 3, split_token=ids_of["<mask>"]))


def test_fim_in_concat_rows_rewrites_whole_documents_and_resumes(cache_dir, fim_tokenizer):
    fim = FIM.from_tokenizer(fim_tokenizer, 0.5, 0.5)

    def make():
        return ShardDataset(cache_dir, 512, seed=6, transform=fim, mode="pack", seq_len=32,
                            packing="concat", attention="none", streams=0)  # fmt: skip

    sentinels = collections.Counter()
    for batch in make():  # a document longer than a row is cut from its rewritten whole
        meta = batch["meta"]
        cu, ids = meta["cu_seqlens"].tolist(), meta["sample_ids"].tolist()
        flat = batch["input_ids"].reshape(-1)
        for k, i in enumerate(ids):
            if i >= 0:
                piece = flat[cu[k] : cu[k + 1]]
                for s in (fim.prefix_id, fim.middle_id, fim.suffix_id):
                    sentinels[i, s] += int((piece == s).sum())
    with open_cache(cache_dir) as cache:
        count = cache.num_sequences
    per_doc = [tuple(sentinels[i, s] for s in (fim.prefix_id, fim.middle_id, fim.suffix_id))
               for i in range(count)]  # fmt: skip
    assert set(per_doc) == {(0, 0, 0), (1, 1, 1)}  # once each, over all of a document's pieces
    assert abs(per_doc.count((1, 1, 1)) / count - 0.5) < 0.03
    assert_resumable(make, iter, _key, steps=[7])


# ---- preference pairs: a lengthening transform on both sides of a pair -----------------------


@pytest.mark.parametrize("streams", [0, 2])
@pytest.mark.parametrize("mode", ["pad", "pack"])
def test_a_lengthening_transform_on_preference_pairs(pairs_cache, mode, streams):
    """``Grow`` adds exactly ``growth`` untrained tokens to each side: no batch is over its
    budget, a pair's two sides stay in one batch (pad: adjacent rows; pack: adjacent segments
    of one row), every side is its stored length plus the growth in ``cu_seqlens`` and the
    attention mask, and ``pair_logps`` sums exactly the stored completion tokens."""
    import torch

    import shardcache

    growth = 4
    with open_cache(pairs_cache) as cache:
        lengths = np.asarray(cache.lengths, dtype=np.int64)
        trained = np.array([m.sum() for m in cache.read_masks(np.arange(len(lengths)))])
    longest_pair = int((lengths[0::2] + lengths[1::2]).max())
    budget = 6 * (longest_pair + 2 * growth)
    extra = {"mode": "pack", "seq_len": longest_pair + 2 * growth, "attention": "varlen"}
    ds = ShardDataset(pairs_cache, budget, seed=4, transform=Grow(growth), streams=streams,
                      **(extra if mode == "pack" else {}))  # fmt: skip
    assert ds.options.growth == growth
    seen = collections.Counter()
    vocab = 1000
    for batch in ds:
        ids = batch["input_ids"]
        assert ids.numel() <= budget
        meta = batch["meta"]
        samples, pairs, side = (meta[k].numpy() for k in ("sample_ids", "pair_ids", "side"))
        real = samples >= 0
        if mode == "pad":
            got = batch["attention_mask"].sum(dim=1).numpy()
            rows = np.arange(len(samples))
        else:
            cu = meta["cu_seqlens"].numpy()
            got = np.diff(cu)
            rows = cu[:-1] // ids.shape[1]
            assert (rows == (cu[1:] - 1) // ids.shape[1]).all()  # no segment crosses a row
            assert int(meta["num_tokens"]) == int(got[real].sum())
        samples, pairs, side, got, rows = (a[real] for a in (samples, pairs, side, got, rows))
        # chosen then rejected, adjacent, in one row (pack) or two adjacent rows (pad)
        assert (side[0::2] == 0).all() and (side[1::2] == 1).all()
        assert (pairs[0::2] == pairs[1::2]).all() and (samples == 2 * pairs + side).all()
        if mode == "pack":
            assert (rows[0::2] == rows[1::2]).all()
        assert (got == lengths[samples] + growth).all()
        chosen, rejected = shardcache.pair_logps(torch.zeros(*ids.shape, vocab), batch)
        per_token = -float(np.log(vocab))
        assert np.allclose(chosen.numpy(), trained[samples[0::2]] * per_token)
        assert np.allclose(rejected.numpy(), trained[samples[1::2]] * per_token)
        seen.update(pairs[0::2].tolist())
    if streams == 0:  # every pair once
        assert sorted(seen) == list(range(len(lengths) // 2)) and set(seen.values()) == {1}
    else:
        assert set(seen.values()) == {1} and len(seen) > 0.9 * len(lengths) // 2


@pytest.mark.parametrize("mode", ["pad", "pack"])
def test_a_repeated_pair_gets_its_own_randomness_per_repetition(pairs_cache, mode):
    """A preference source used 2.5 times an epoch repeats pairs whole; each copy of a side is
    transformed with its own generator, as a repeated document of a text cache is."""
    extra = {"mode": "pack", "seq_len": 96, "attention": "varlen"} if mode == "pack" else {}

    def make():
        return ShardDataset([Source(pairs_cache, max_repetitions=2.5)], 1024, seed=1,
                            transform=_stamp, streams=0, **extra)  # fmt: skip

    copies = collections.defaultdict(list)
    for batch in make():
        meta = batch["meta"]
        if mode == "pad":
            spans = [(r, 0, int(n)) for r, n in enumerate(batch["attention_mask"].sum(dim=1))]
            ids = batch["input_ids"]
        else:
            cu = meta["cu_seqlens"].tolist()
            ids = batch["input_ids"].reshape(1, -1)
            spans = [(0, cu[k], cu[k + 1] - cu[k]) for k in range(len(cu) - 1)]
        for (row, at, n), sample in zip(spans, meta["sample_ids"].tolist()):
            if sample >= 0:
                copies[sample].append(tuple(ids[row, at : at + n].tolist()))
    with open_cache(pairs_cache) as cache:
        assert len(copies) == cache.num_sequences
    assert {len(c) for c in copies.values()} == {2, 3}
    assert all(len(set(c)) == len(c) for c in copies.values())
    assert_resumable(make, iter, _key, steps=[3])


@pytest.mark.parametrize(
    ("cache", "streams", "world"),
    [("cache_dir", 0, 3), ("cache_dir", 5, 3), ("pairs_cache", 0, 3)],
)
def test_a_batch_that_tail_wrap_reads_again_gets_its_own_randomness(cache, streams, world,
                                                                    request):  # fmt: skip
    """``tail="wrap"`` evens the ranks out by reading some batches a second time in the epoch
    (the epoch's first global batches, canonical streams or not): each such read is a second
    use of its sequences and gets its own transform randomness, as a mixture's repeated
    document does; every first read is transformed as with ``tail="drop"``, and resume is exact.
    (Preference pairs: each side.)"""
    cache_dir = request.getfixturevalue(cache)

    def make(rank: int, tail: str = "wrap") -> ShardDataset:
        return ShardDataset(cache_dir, 1024, seed=1, transform=_stamp, streams=streams,
                            shuffle_block=2048, rank=rank, world_size=world, tail=tail)  # fmt: skip

    report = make(0).tail_report()
    assert report["repeated_batches"] > 0
    copies = collections.defaultdict(list)
    for rank in range(world):
        for batch in make(rank):
            width = batch["attention_mask"].sum(dim=1).tolist()
            for row, (sample, n) in enumerate(zip(batch["meta"]["sample_ids"].tolist(), width)):
                copies[sample].append(tuple(batch["input_ids"][row, :n].tolist()))
    assert max(len(c) for c in copies.values()) >= 2
    assert all(len(set(c)) == len(c) for c in copies.values())
    dropped = {
        sample: tuple(batch["input_ids"][row, :n].tolist())
        for rank in range(world)
        for batch in make(rank, "drop")
        for row, (sample, n) in enumerate(
            zip(batch["meta"]["sample_ids"].tolist(), batch["attention_mask"].sum(dim=1).tolist())
        )
    }
    assert all(copies[sample][0] == tokens for sample, tokens in dropped.items())
    steps = len(list(make(world - 1)))
    assert_resumable(lambda: make(world - 1), iter, _key, steps=[steps - 2, steps - 1])


# ---- every id a transform returns is checked (issue 57) ---------------------------------------


@dataclasses.dataclass(frozen=True)
class _Puts:
    """Put ``value`` (any Python or numpy value) at the first token, as ``dtype``."""

    value: object
    dtype: str = "int64"

    def __call__(self, ids, mask, rng):
        out = ids.astype(self.dtype)
        out[0] = self.value
        return out, mask


@pytest.mark.parametrize(
    ("value", "dtype", "match"),
    [
        (-1, "int64", r"returned id -1 .*ids are 0 to {top}"),
        ("top+1", "int64", r"returned id {over} .*past the largest id {top}"),
        (2**32 + 7, "int64", r"returned id 4294967303 .*past the largest id .*wrap to 7"),
        (2**32 + 7, "uint64", r"returned id 4294967303 "),
        (1035.7, "float64", r"returned id 1035\.7 .*not a whole number"),
        (float("nan"), "float64", r"returned id nan "),
        (True, "bool", r"returned ids of dtype bool"),
    ],
)
@pytest.mark.parametrize("cache", ["cache_dir", "chat_cache"])
def test_every_id_a_transform_returns_is_checked(cache, value, dtype, match, request):
    """A returned id below 0, past the cache's largest id, not whole, or that the ids dtype
    cannot hold (it would wrap) is refused with the transform, the sample and the value named;
    a transform is never compiled (it forces the numpy path), so this check is the only one."""
    path = request.getfixturevalue(cache)
    with open_cache(path) as opened:
        top = int(opened.manifest["tokenizer"]["max_token_id"])
    value = top + 1 if value == "top+1" else value
    transform = _Puts(value, dtype)
    ds = ShardDataset(path, 1024, transform=transform)
    assert not ds.reads_compiled
    want = rf"transform {re.escape(repr(transform))}: sample \d+ .*"
    with pytest.raises(ConfigError, match=want + match.format(top=top, over=top + 1)):
        next(iter(ds))


@pytest.mark.parametrize("cache", ["cache_dir", "chat_cache"])
def test_ids_a_transform_returns_at_the_edges_of_the_vocabulary_are_kept(cache, request):
    """0 and the largest id are real ids; whole floats are ids: labels are -100 or a real id."""
    path = request.getfixturevalue(cache)
    with open_cache(path) as opened:
        top = int(opened.manifest["tokenizer"]["max_token_id"])
    for transform in (_Puts(0), _Puts(top, "uint64"), _Puts(float(top), "float64")):
        for batch in ShardDataset(path, 1024, transform=transform):
            ids, labels = batch["input_ids"], batch["labels"]
            assert int(ids.min()) >= 0 and int(ids.max()) <= top
            assert ((labels == -100) | ((labels >= 0) & (labels <= top))).all()
