"""DPO on cached pairs against TRL: the recipe's loss equals ``DPOTrainer``'s on the same records
(TRL tokenizing them itself), and ``DPOTrainer`` trains on pairs read from a preference cache."""

from __future__ import annotations

import copy
import math
import os
from typing import Any

import numpy as np
import pytest
import torch

from conftest import load_recipe as recipe
from conftest import make_chat_pairs, make_string_pairs, write_records
from shardcache import ConfigError, MissingDependencyError, ShardDataset, open_cache

trl = pytest.importorskip("trl")

# TRL 1.16 still calls transformers' gradient-checkpointing names, which transformers 5 renamed
pytestmark = pytest.mark.filterwarnings("ignore:.*checkpointing.* is deprecated:FutureWarning")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BETA = 0.1


def make_pairs(n: int, seed: int = 0) -> list[dict[str, str]]:
    """String pairs with completions of at most 10 words."""
    return make_string_pairs(n, seed, longest=10)


#: (tokenizer fixture, model architecture, records): string pairs with a tokenizer adding no
#: BOS (Qwen2) and one whose post-processor adds BOS (Llama); message-list pairs rendered with
#: a ChatML template (built without EOS: TRL appends none to conversations)
SETUPS = [
    ("tokenizer_dir", "qwen2", "strings"),
    ("bos_tokenizer_dir", "llama", "strings"),
    ("chatml_tokenizer_dir", "qwen2", "chat"),
]


@pytest.fixture(scope="module", params=SETUPS, ids=["no-bos-qwen2", "bos-llama", "chatml-qwen2"])
def pairs(request, tmp_path_factory) -> tuple[list[dict[str, Any]], str, str, str]:
    """(records, tokenizer folder, preference cache of them, architecture): 14 pairs."""
    from shardcache.builder.run import build_cache
    from shardcache.config import build_options_from_mapping

    fixture, arch, shape = request.param
    tokenizer = request.getfixturevalue(fixture)
    folder = tmp_path_factory.mktemp("trl-pairs")
    records = make_pairs(14, seed=3) if shape == "strings" else make_chat_pairs(14, seed=3)
    path = write_records(str(folder / "pairs.jsonl"), records, "jsonl")
    out = str(folder / "cache")
    values = {
        "input": path,
        "tokenizer": tokenizer,
        "output": out,
        "workers": 1,
        "kind": "preference",
        "buckets": "24",
    }  # the defaults: as TRL, EOS on strings only
    build_cache(build_options_from_mapping(values))
    return records, tokenizer, out, arch


def trl_trainer(records, tokenizer_dir, policy, reference, tmp_path, trainer_class=None):
    """A ``DPOTrainer`` (sigmoid loss, ``BETA``, float32) on string records, TRL tokenizing them.

    ``bf16=False``: TRL's default is bf16 mixed precision, even on CPU, and it prepares the
    reference model (autocast forward) at construction but the policy only in ``train()``.
    """
    from datasets import Dataset
    from transformers import AutoTokenizer

    config = trl.DPOConfig(
        output_dir=str(tmp_path / "trl"), beta=BETA, max_length=None, report_to="none",
        use_cpu=True, bf16=False, activation_checkpointing=False,
        per_device_train_batch_size=len(records),
    )  # fmt: skip
    return (trainer_class or trl.DPOTrainer)(
        model=copy.deepcopy(policy),
        ref_model=copy.deepcopy(reference),
        args=config,
        train_dataset=Dataset.from_list(records) if isinstance(records, list) else records,
        processing_class=AutoTokenizer.from_pretrained(tokenizer_dir),
    )


def our_pair_losses(cache_path, policy, reference, mode: str = "pad") -> dict[int, float]:
    """Per record index, the recipe's DPO loss of its pair, read as pair batches (pad or pack)."""
    dpo = recipe("train_dpo")
    cache = open_cache(cache_path)
    lengths = np.asarray(cache.lengths)
    if mode == "pad":
        budget, options = 6 * int(lengths.max()), {}  # three pairs or more a batch
    else:  # rows just long enough for the longest pair, two rows a batch
        seq_len = int((lengths[0::2] + lengths[1::2]).max())
        budget, options = 2 * seq_len, {"mode": "pack", "seq_len": seq_len, "attention": "mask"}
    losses: dict[int, float] = {}
    shared_rows = 0  # pack batches with more pairs than rows: pairs share a row
    with torch.no_grad():
        for batch in ShardDataset(cache_path, budget, seed=0, streams=0, **options):
            pairs = dpo.batch_pairs(batch)
            shared_rows += len(pairs) > batch["input_ids"].shape[0]
            pol, ref = dpo.pair_logps(policy, batch), dpo.pair_logps(reference, batch)
            each, _ = dpo.dpo_losses(*pol, *ref, BETA)
            assert len(each) == len(pairs)
            for pair, loss in zip(pairs.tolist(), each.tolist()):
                losses[cache.lookup(2 * pair).record] = loss
            whole, _ = dpo.dpo_loss(*pol, *ref, BETA)  # the batch mean is the pairs' mean
            assert whole.item() == pytest.approx(each.mean().item(), abs=1e-6)
    assert mode == "pad" or shared_rows > 0
    return losses


def test_dpo_loss_equals_trl_at_step_0(pairs, tmp_path):
    records, tokenizer_dir, cache_path, arch = pairs
    dpo = recipe("train_dpo")
    vocab = int(open_cache(cache_path).manifest["tokenizer"]["vocab_size"])
    torch.manual_seed(0)
    policy = dpo.tiny_model(vocab, 32, 128, arch).eval()
    torch.manual_seed(1)
    other = dpo.tiny_model(vocab, 32, 128, arch).eval()  # a reference unlike the policy

    for reference, ln2 in ((copy.deepcopy(policy), True), (other, False)):
        trainer = trl_trainer(records, tokenizer_dir, policy, reference, tmp_path)
        rows = [trainer.train_dataset[i] for i in range(len(records))]
        # TRL's own tokenization of the records is the cache's: same ids, same completion
        cache = open_cache(cache_path)
        for sample in range(cache.num_sequences):
            row = rows[cache.lookup(sample).record]
            side = row["chosen_ids"] if sample % 2 == 0 else row["rejected_ids"]
            assert cache.read(sample).tolist() == row["prompt_ids"] + side
            mask = cache.read_masks(np.array([sample]))[0]
            assert mask.tolist() == [False] * len(row["prompt_ids"]) + [True] * len(side)
        with torch.no_grad():
            trl_each = [
                trainer.compute_loss(trainer.model, trainer.data_collator([row])).item()
                for row in rows
            ]
            trl_mean = trainer.compute_loss(trainer.model, trainer.data_collator(rows)).item()
        for mode in ("pad", "pack"):
            ours = our_pair_losses(cache_path, policy, reference, mode)
            assert sorted(ours) == list(range(len(records))), mode
            assert [ours[k] for k in range(len(records))] == pytest.approx(trl_each, abs=1e-5)
            assert np.mean(list(ours.values())) == pytest.approx(trl_mean, abs=1e-5)
        if ln2:  # reference = policy: every pair's loss is ln 2
            assert trl_mean == pytest.approx(math.log(2), abs=1e-6)
        else:
            spread = max(abs(x - math.log(2)) for x in trl_each)
            assert spread > 5e-3, spread  # the comparison is not the trivial one


def test_trl_pairs_are_the_cache_rows_and_dpo_trainer_trains_on_them(pairs, tmp_path):
    records, tokenizer_dir, cache_path, _ = pairs
    from shardcache.integrations.hf import trl_pairs

    adapter = recipe("train_dpo_trl")
    dataset = trl_pairs(cache_path)
    cache = open_cache(cache_path)
    assert len(dataset) == cache.num_sequences // 2 == len(records)
    for k, row in enumerate(dataset):
        for sample, side in ((2 * k, row["chosen_ids"]), (2 * k + 1, row["rejected_ids"])):
            assert cache.read(sample).tolist() == row["prompt_ids"] + side
            trainable = int(cache.read_masks(np.array([sample]))[0].sum())
            assert trainable == len(side) > 0

    report = adapter.main([cache_path, tokenizer_dir, "--output-dir", str(tmp_path / "out"),
                           "--max-steps", "3", "--logging-steps", "1", "--batch-size", "4",
                           "--hidden", "32"])  # fmt: skip
    losses = report["losses"]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
    assert losses[0] == pytest.approx(math.log(2), abs=1e-5)  # step 0: policy = reference
    assert losses[-1] != pytest.approx(math.log(2), abs=1e-5)  # and it trained


def test_plain_dpo_trainer_tokenizes_again_so_cached_rows_need_the_adapter(pairs, tmp_path):
    """TRL's current API maps every train dataset through its tokenization: pre-tokenized rows
    (``prompt_ids``, ``chosen_ids``, ``rejected_ids``) alone fail there. When this test fails,
    TRL accepts them: drop ``CachedPairsDPOTrainer`` and update docs/guide/preference.md."""
    _, tokenizer_dir, cache_path, _ = pairs
    from shardcache.integrations.hf import CachedPairsDPOTrainer, trl_pairs

    dpo = recipe("train_dpo")
    vocab = int(open_cache(cache_path).manifest["tokenizer"]["vocab_size"])
    model = dpo.tiny_model(vocab, 32, 128)
    with pytest.raises(KeyError, match="chosen"):
        trl_trainer(trl_pairs(cache_path), tokenizer_dir, model, model, tmp_path)
    adapted = trl_trainer(trl_pairs(cache_path), tokenizer_dir, model, model, tmp_path,
                          CachedPairsDPOTrainer)  # fmt: skip
    assert adapted.train_dataset.column_names == ["prompt_ids", "chosen_ids", "rejected_ids"]


def test_trl_pairs_refuses_a_completion_with_an_untrained_turn_naming_the_pair(
    tmp_path, build_cache, chatml_tokenizer_dir
):
    """TRL trains on the whole completion: a chosen side of two assistant turns around a user
    turn (untrained) cannot become TRL's rows; a one-turn chat pair can."""

    def turn(role: str, text: str) -> dict[str, str]:
        return {"role": role, "content": text}

    one = {"prompt": [turn("user", "2 + 2 ?")], "chosen": [turn("assistant", "4")],
           "rejected": [turn("assistant", "5")]}  # fmt: skip
    two = {"prompt": [turn("user", "3 + 3 ?")],
           "chosen": [turn("assistant", "6"), turn("user", "sure ?"), turn("assistant", "yes")],
           "rejected": [turn("assistant", "7")]}  # fmt: skip
    from shardcache.integrations.hf import trl_pairs

    path = write_records(str(tmp_path / "one.jsonl"), [one, one], "jsonl")
    cache = build_cache(path, chatml_tokenizer_dir, kind="preference")
    assert len(trl_pairs(cache)) == 2
    path = write_records(str(tmp_path / "two.jsonl"), [one, two, one], "jsonl")
    cache = build_cache(path, chatml_tokenizer_dir, kind="preference")
    built = open_cache(cache)
    k = next(k for k in range(3) if built.lookup(2 * k).record == 1)  # the two-turn pair
    with pytest.raises(ConfigError, match=rf"pair {k} \(sample ids {2 * k}, .*\(1 of 3 pairs"):
        trl_pairs(cache)
    text = build_cache(write_records(str(tmp_path / "t.jsonl"), [{"text": "a b"}], "jsonl"),
                       chatml_tokenizer_dir)  # fmt: skip
    with pytest.raises(ConfigError, match="is not a preference cache; build it with --preference"):
        trl_pairs(open_cache(text))


def test_a_trl_without_the_overridden_method_is_named_with_the_versions_to_install():
    """CachedPairsDPOTrainer overrides DPOTrainer._prepare_dataset, a private method: a TRL
    without it (or taking other arguments) is refused when the adapter is imported."""
    from shardcache.integrations.hf.trl_dpo import check_dpo_trainer

    check_dpo_trainer(trl.DPOTrainer)  # the installed TRL has it

    class Renamed:
        def _prepare_dataset(self, dataset, processing_class, args):
            return dataset

    for cls in (object, Renamed):
        with pytest.raises(
            MissingDependencyError,
            match=r"_prepare_dataset\(dataset, "
            r"processing_class, args, dataset_name\).*trl>=1\.16,<2.*\[train\]",
        ):
            check_dpo_trainer(cls)


def test_trl_tokenizes_prompt_and_completion_as_one_text_the_cache_apart(
    tmp_path, build_cache, tokenizer_dir
):
    """What docs/guide/preference.md says of string pairs: TRL tokenizes the prompt alone and
    prompt + completion as one text (the completion starts where they diverge), the cache
    tokenizes them apart. The ids agree when the prompt ends on a token boundary (a completion
    starting with a space) and differ when a token spans the boundary (a prompt ending mid-word)."""
    from transformers import AutoTokenizer

    from conftest import WORDS

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    # a word the tokenizer spells as one token after a space, cut in two across the boundary
    word = next(w for w in WORDS if len(w) >= 4 and len(tok(" " + w).input_ids) == 1)
    glued = {"prompt": "say " + word[:2], "chosen": word[2:] + " now", "rejected": " no"}
    spaced = {"prompt": "say " + word, "chosen": " now", "rejected": " no"}
    records = [spaced, glued]
    path = write_records(str(tmp_path / "pairs.jsonl"), records, "jsonl")
    cache = open_cache(build_cache(path, tokenizer_dir, kind="preference"))
    dpo = recipe("train_dpo")
    model = dpo.tiny_model(int(cache.manifest["tokenizer"]["vocab_size"]), 32, 128)
    rows = trl_trainer(records, tokenizer_dir, model, model, tmp_path).train_dataset
    same = {}
    for sample in range(cache.num_sequences):
        record = cache.lookup(sample).record
        row = rows[record]
        side = row["chosen_ids"] if sample % 2 == 0 else row["rejected_ids"]
        same[record, sample % 2] = cache.read(sample).tolist() == row["prompt_ids"] + side
    assert same == {(0, 0): True, (0, 1): True, (1, 0): False, (1, 1): True}
