"""Per-message loss weights on the read side: ``loss_weights`` in every batch layout, through
DataLoader workers, resume, mixtures and transforms; ``show``; the weighted loss."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from conftest import assert_resumable, load_recipe, make_conversations, make_model, write_records
from shardcache import ShardDataset, Source, loader, weighted_loss
from shardcache.cli import main
from shardcache.errors import ConfigError
from shardcache.read.collate.layout import IGNORE_INDEX
from shardcache.store.cache import open_cache

WEIGHTS = (1, 0.5, 0.25, 0, None)  # None: the message carries no weight (1)


def weighted_records(n: int, seed: int) -> list[dict]:
    """Chat records whose assistant turns carry weights drawn from ``WEIGHTS``."""
    rng = random.Random(seed)
    records = []
    for conv in make_conversations(n, seed=seed):
        for message in conv:
            weight = rng.choice(WEIGHTS)
            if message["role"] == "assistant" and weight is not None:
                message["weight"] = weight
        records.append({"messages": conv})
    return records


@pytest.fixture(scope="module")
def weighted(tmp_path_factory, chatml_tokenizer_dir) -> str:
    """A chat cache with loss weights, several shards in two buckets."""
    from shardcache.builder.run import build_cache
    from shardcache.config import build_options_from_mapping

    folder = tmp_path_factory.mktemp("weighted")
    path = write_records(str(folder / "chat.jsonl"), weighted_records(120, seed=7), "jsonl")
    out = str(folder / "cache")
    values = {
        "input": path, "tokenizer": chatml_tokenizer_dir, "output": out, "workers": 1,
        "chat": True, "weight_field": "weight", "buckets": "48", "shard_size": 4096,
    }  # fmt: skip
    build_cache(build_options_from_mapping(values))
    return out


@pytest.fixture(scope="module")
def stored(weighted) -> list[np.ndarray]:
    with open_cache(weighted) as cache:
        assert cache.has_weights and len(cache.shards) > 2
        return cache.read_weights(np.arange(cache.num_sequences))


def check_batch(batch: dict, stored: list[np.ndarray]) -> int:
    """Every slot of ``loss_weights`` is its token's stored weight, 0 where labels are -100."""
    weights, labels = batch["loss_weights"].numpy(), batch["labels"].numpy()
    assert weights.dtype == np.float32 and weights.shape == labels.shape
    assert ((labels == IGNORE_INDEX) == (weights == 0)).all()
    meta = batch["meta"]
    sample_ids = meta["sample_ids"].numpy()
    if "cu_seqlens" in meta:  # pack: segments of the flat rows, each from its offset
        flat, cu = weights.reshape(-1), meta["cu_seqlens"].numpy()
        offsets = meta["sample_offsets"].numpy()
        for k, sample in enumerate(sample_ids.tolist()):
            got = flat[cu[k] : cu[k + 1]]
            if sample < 0:
                assert not got.any()
                continue
            want = stored[sample][offsets[k] : offsets[k] + len(got)].copy()
            want[0] = 0  # a segment's first token is never a target
            np.testing.assert_array_equal(got, want)
    else:  # pad: a sequence per row, then padding
        for row, sample in enumerate(sample_ids.tolist()):
            n = len(stored[sample])
            np.testing.assert_array_equal(weights[row, :n], stored[sample])
            assert not weights[row, n:].any()
    return int((sample_ids >= 0).sum())


LAYOUTS = {
    "pad": {},
    "best_fit": {"mode": "pack", "seq_len": 96, "attention": "mask"},
    "concat": {"mode": "pack", "seq_len": 64, "packing": "concat", "attention": "varlen"},
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_batches_carry_the_stored_weights(weighted, stored, layout):
    ds = ShardDataset(weighted, max_tokens=192, seed=3, **LAYOUTS[layout])
    assert not ds.reads_compiled  # a weighted cache takes the numpy path
    segments = sum(check_batch(batch, stored) for batch in ds)
    assert segments >= len(stored)
    assert any(set(np.unique(w).tolist()) - {0.0, 1.0} for w in stored)  # fractions stored


def test_canonical_streams_over_two_ranks_carry_the_weights(weighted, stored):
    seen = []
    for rank in range(2):
        ds = ShardDataset(weighted, max_tokens=192, seed=3, rank=rank, world_size=2, streams=2)
        for batch in ds:
            check_batch(batch, stored)
            seen += batch["meta"]["sample_ids"].tolist()
    assert set(seen) == set(range(len(stored)))


def test_the_kernels_option_changes_nothing(weighted):
    def run(kernels: bool) -> list:
        ds = ShardDataset(weighted, max_tokens=192, seed=1, mode="pack", seq_len=96,
                          attention="none")  # fmt: skip
        ds.kernels = kernels
        return [b["loss_weights"].tolist() for b in ds]

    assert run(True) == run(False)


def test_dataloader_workers_give_the_same_batches(weighted, stored):
    def run(workers: int) -> list:
        with loader(weighted, 192, seed=2, mode="pack", seq_len=96, attention="none",
                    num_workers=workers) as batches:  # fmt: skip
            out = []
            for batch in batches:
                check_batch(batch, stored)
                out.append((batch["meta"]["sample_ids"].tolist(), batch["loss_weights"].tolist()))
            return out

    assert run(2) == run(0)


def test_resume_gives_the_same_weights(weighted):
    def make() -> ShardDataset:
        return ShardDataset(weighted, max_tokens=192, seed=4, mode="pack", seq_len=64,
                            packing="concat", attention="none")  # fmt: skip

    assert_resumable(make, iter, key=lambda b: b["loss_weights"].tolist(), steps=[0, 2, 5])


def test_a_mixture_of_weighted_and_unweighted_chat_caches(
    weighted, stored, tmp_path, chatml_tokenizer_dir, build_cache
):
    records = [{"messages": m} for m in make_conversations(40, seed=11)]
    plain = build_cache(write_records(str(tmp_path / "plain.jsonl"), records, "jsonl"),
                        chatml_tokenizer_dir, chat=True)  # fmt: skip
    with open_cache(plain) as cache:
        assert not cache.has_weights
        masks = cache.read_masks(np.arange(cache.num_sequences))
    sources = [Source(weighted, weight=0.5), Source(plain, weight=0.5)]
    ds = ShardDataset(sources, max_tokens=192, seed=5)
    seen = set()
    for batch in ds:
        weights, labels = batch["loss_weights"].numpy(), batch["labels"].numpy()
        assert ((labels == IGNORE_INDEX) == (weights == 0)).all()
        meta = batch["meta"]
        for row, source in enumerate(meta["source_ids"].tolist()):
            local = int(meta["sample_ids"][row])
            want = stored[local] if source == 0 else masks[local].astype(np.float32)
            np.testing.assert_array_equal(weights[row, : len(want)], want)
            seen.add(source)
    assert seen == {0, 1}


class Halve:
    """Keeps the length; the first half of the tokens untrainable, the second half trainable."""

    def __call__(self, ids, mask, rng):
        mask = mask.copy()
        mask[: len(ids) // 2] = False
        mask[len(ids) // 2 :] = True
        return ids, mask


def test_weights_stay_at_their_positions_through_a_transform(weighted, stored):
    ds = ShardDataset(weighted, max_tokens=192, seed=6, transform=Halve())
    for batch in ds:
        weights = batch["loss_weights"].numpy()
        for row, sample in enumerate(batch["meta"]["sample_ids"].tolist()):
            own = stored[sample]
            half = len(own) // 2
            want = np.where(own > 0, own, 1).astype(np.float32)  # made trainable: 1
            want[:half] = 0
            np.testing.assert_array_equal(weights[row, : len(own)], want)


class Grow:
    max_growth = 2

    def __call__(self, ids, mask, rng):
        return np.concatenate([ids, ids[:2]]), np.concatenate([mask, [False, False]])


class Shorten:
    def __call__(self, ids, mask, rng):
        return ids[:-1], mask[:-1]


def test_transforms_that_change_the_length_are_refused(weighted):
    with pytest.raises(ConfigError, match=r"max_growth=2.*loss weights"):
        ShardDataset(weighted, max_tokens=192, transform=Grow())
    ds = ShardDataset(weighted, max_tokens=192, transform=Shorten())
    with pytest.raises(ConfigError, match="must keep each sequence's length"):
        next(iter(ds))


def test_a_filler_evaluation_batch_weighs_nothing(weighted):
    from shardcache.read.batch import mark_filler

    batch = next(iter(ShardDataset(weighted, max_tokens=192)))
    mark_filler(batch, True)
    assert not batch["loss_weights"].any()


def test_show_prints_the_stored_weights(weighted, stored):
    runner = CliRunner()
    result = runner.invoke(main, ["show", weighted, "-n", "0", "-n", "1", "--json"])
    assert result.exit_code == 0, result.output
    for entry in json.loads(result.output)["sequences"]:
        want = stored[entry["sample_id"]]
        assert entry["weights"] == want.tolist()
        for run in entry["runs"]:  # runs cut where the weight changes, each with its weight
            assert (want[run["start"] : run["end"]] == run["weight"]).all()
            assert run["trainable"] == (run["weight"] > 0)
    fractional = next(i for i, w in enumerate(stored) if ((w > 0) & (w < 1)).any())
    result = runner.invoke(main, ["show", weighted, "-n", str(fractional), "--no-color"])
    assert result.exit_code == 0 and "{w=0." in result.output, result.output
    result = runner.invoke(main, ["show", weighted, "--batch", "0", "--json"])
    assert result.exit_code == 0, result.output
    segments = [s for row in json.loads(result.output)["rows"] for s in row["segments"]]
    assert all(
        s["loss_weights"] == stored[s["sample_id"]].tolist() for s in segments if not s["padding"]
    )


def test_the_hf_export_keeps_the_weights(weighted, stored, tmp_path):
    datasets = pytest.importorskip("datasets")
    from shardcache import ExportOptions, export_cache

    out = str(tmp_path / "hf")
    report = export_cache(weighted, out, ExportOptions("hf"))
    assert report.loss_mask
    dataset = datasets.load_from_disk(out)
    assert dataset.column_names == ["input_ids", "loss_mask", "loss_weights"]
    got = dataset["loss_weights"]
    assert len(got) == len(stored)
    for row, want in zip(got, stored):
        np.testing.assert_array_equal(np.asarray(row, np.float32), want)


def reference_loss(model, batch: dict, stored: list[np.ndarray]) -> torch.Tensor:
    """The weighted loss sequence by sequence: each segment alone through the model."""
    total, weight = torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.float64)
    meta, ids = batch["meta"], batch["input_ids"]
    flat = ids.reshape(-1)
    if "cu_seqlens" in meta:
        cu, offsets = meta["cu_seqlens"].tolist(), meta["sample_offsets"].tolist()
        pieces = [
            (flat[cu[k] : cu[k + 1]], stored[s][offsets[k] : offsets[k] + cu[k + 1] - cu[k]])
            for k, s in enumerate(meta["sample_ids"].tolist())
            if s >= 0
        ]
    else:
        pieces = [
            (ids[row, : len(stored[s])], stored[s])
            for row, s in enumerate(meta["sample_ids"].tolist())
        ]
    for tokens, weights in pieces:
        logits = model(input_ids=tokens[None].long(), use_cache=False).logits[0, :-1].double()
        losses = torch.nn.functional.cross_entropy(logits, tokens[1:].long(), reduction="none")
        w = torch.from_numpy(np.asarray(weights[1:], dtype=np.float64))
        total += (losses * w).sum()
        weight += w.sum()
    return total / weight


@pytest.mark.parametrize("layout", ["pad", "best_fit", "concat"])
def test_the_recipes_weighted_loss_equals_a_reference_sequence_by_sequence(
    weighted, stored, layout
):
    train = load_recipe("train_loop")
    vocab = int(open_cache(weighted).manifest["tokenizer"]["vocab_size"])
    model = make_model("qwen2", "eager", vocab)
    options = {**LAYOUTS[layout]}
    if options.get("attention"):
        options["attention"] = "mask"  # exact with eager attention
    batches = iter(ShardDataset(weighted, max_tokens=192, seed=8, **options))
    for _ in range(2):
        batch = next(batches)
        extra = {"use_cache": False}
        got = train.batch_loss(model, batch, **extra)
        want = reference_loss(model, batch, stored)
        assert got.item() == pytest.approx(want.item(), rel=1e-4)
        inputs = {k: v for k, v in batch.items() if k not in ("meta", "loss_weights", "labels")}
        logits = model(**inputs, use_cache=False).logits
        assert weighted_loss(logits, batch).item() == pytest.approx(got.item(), rel=1e-6)


def test_weighted_loss_with_unit_weights_is_the_models_own_loss(tmp_path, chatml_tokenizer_dir,
                                                                build_cache):  # fmt: skip
    records = [{"messages": m} for m in make_conversations(12, seed=2)]
    path = build_cache(write_records(str(tmp_path / "c.jsonl"), records, "jsonl"),
                       chatml_tokenizer_dir, chat=True, weight_field="weight")  # fmt: skip
    batch = next(iter(ShardDataset(path, max_tokens=256)))
    assert set(np.unique(batch["loss_weights"].numpy()).tolist()) == {0.0, 1.0}
    vocab = int(open_cache(path).manifest["tokenizer"]["vocab_size"])
    model = make_model("qwen2", "eager", vocab)
    inputs = {k: v for k, v in batch.items() if k not in ("meta", "loss_weights")}
    outputs = model(**inputs)
    assert weighted_loss(outputs.logits, batch).item() == pytest.approx(outputs.loss.item(), 1e-5)


def test_weighted_loss_refuses_a_batch_without_weights(weighted):
    batch = next(iter(ShardDataset(weighted, max_tokens=192)))
    batch.pop("loss_weights")
    with pytest.raises(ConfigError, match="no loss_weights"):
        weighted_loss(torch.zeros(*batch["labels"].shape, 5), batch)


def test_the_plain_loop_trains_on_a_weighted_cache(weighted):
    train = load_recipe("train_loop")
    report = train.main([weighted, "--max-tokens", "192", "--seq-len", "96", "--steps", "6",
                         "--overfit-batch", "--num-workers", "0", "--log-every", "6"])  # fmt: skip
    losses = report["losses"]
    assert len(losses) == 6 and losses[-1] < losses[0]


def test_the_hf_trainer_recipe_uses_the_weighted_loss(weighted, tmp_path, stored):
    train = load_recipe("train_hf_trainer")
    from transformers import TrainingArguments

    vocab = int(open_cache(weighted).manifest["tokenizer"]["vocab_size"])
    model = make_model("qwen2", "eager", vocab)
    batch = next(iter(ShardDataset(weighted, max_tokens=192, seed=8)))
    args = TrainingArguments(output_dir=str(tmp_path / "out"), report_to=[], use_cpu=True)
    with loader(weighted, 192, num_workers=0) as shard_loader:
        trainer = train.ShardTrainer(model=model, args=args, shard_loader=shard_loader)
        got = trainer.compute_loss(model, dict(batch), num_items_in_batch=None)
    assert got.item() == pytest.approx(reference_loss(model, batch, stored).item(), rel=1e-4)
    report = train.main([weighted, "--max-tokens", "192", "--seq-len", "96",
                         "--output-dir", str(tmp_path / "run"), "--max-steps", "6",
                         "--logging-steps", "3", "--num-workers", "0",
                         "--validation", "0.25"])  # fmt: skip
    assert all(np.isfinite(report["losses"])) and 0 < report["eval"]["eval_loss"] < 20
