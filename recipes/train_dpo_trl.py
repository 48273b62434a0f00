#!/usr/bin/env python3
"""Train with TRL's ``DPOTrainer`` on the pairs of a preference cache, without tokenizing again.

    shardcache build recipes/dpo.toml
    python recipes/train_dpo_trl.py dpo-cache recipes/quickstart/tokenizer --output-dir out

What TRL (1.x) needs, and what this recipe does about it:

* ``DPOTrainer`` trains on rows of ``prompt_ids``, ``chosen_ids`` and ``rejected_ids`` (token
  lists; its ``DataCollatorForPreference`` joins prompt + completion, pads, and marks the
  completion as the loss tokens). :func:`trl_pairs` makes that ``datasets.Dataset`` from the
  cache: pair ``k`` (sample ids ``2k``, ``2k + 1``) is row ``k``, the prompt is each side's
  tokens before its first trainable one.
* ``DPOTrainer.__init__`` always maps ``train_dataset`` through its tokenization (it has no
  ``skip_prepare_dataset`` as ``SFTTrainer`` has): rows without ``prompt`` / ``chosen`` /
  ``rejected`` strings fail there (``KeyError: 'chosen'``). :class:`CachedPairsDPOTrainer`
  passes a dataset that already holds ``prompt_ids`` through unchanged; it overrides a
  private method of TRL, so pin the TRL version you checked (tests/test_dpo_trl.py trains a
  step this way with the TRL the tests install).
* TRL's collator trains on the whole completion, so a pair converts only when each side's
  trainable tokens are one run to its end and both sides share the prompt: string pairs always
  are; a chat pair whose template leaves untrained tokens after the answer is refused, with
  the pair named (read such caches with ``recipes/train_dpo.py``, which uses the exact masks).

Batches are TRL's (``per_device_train_batch_size`` pairs, padded), not shardcache's token
budgets: use ``recipes/train_dpo.py`` to read pair batches with a token budget, exact resume
and ranks that never split a pair.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import os
from typing import Any

import numpy as np
import pyarrow as pa
import torch
from datasets import Dataset
from transformers import AutoTokenizer
from trl import DPOConfig, DPOTrainer

import shardcache

PAIR_COLUMNS = ("prompt_ids", "chosen_ids", "rejected_ids")


def trl_pairs(cache_path: str) -> Dataset:
    """The cache's pairs as TRL's rows of ``prompt_ids``, ``chosen_ids``, ``rejected_ids``.

    Row ``k`` is pair ``k``. Raises ``ValueError`` (naming the pair) when a side's trainable
    tokens are not one run to its end or the two sides' prompts differ.
    """
    cache = shardcache.open_cache(cache_path)
    if not cache.is_preference:
        raise ValueError(f"{cache_path}: not a preference cache (build it with --preference)")
    got = cache.gather(np.arange(cache.num_sequences), with_mask=True)
    lengths = got.lengths
    row = np.repeat(np.arange(len(lengths)), lengths)
    pos = np.arange(len(got.tokens)) - got.offsets[row]
    first = np.minimum.reduceat(np.where(got.mask, pos, lengths[row]), got.offsets[:-1])
    ragged = np.add.reduceat(got.mask.astype(np.int64), got.offsets[:-1]) != lengths - first
    prompt = first[0::2]
    same = prompt == first[1::2]
    same[same] = [  # equal prompt lengths: compare the tokens
        np.array_equal(got.tokens[a : a + n], got.tokens[b : b + n])
        for a, b, n in zip(got.offsets[0:-1:2][same], got.offsets[1::2][same], prompt[same])
    ]
    bad = np.flatnonzero(ragged[0::2] | ragged[1::2] | ~same)
    if len(bad):
        k = int(bad[0])
        raise ValueError(
            f"{cache_path}: pair {k} (sample ids {2 * k}, {2 * k + 1}) does not split into a "
            "shared prompt and completions trained whole, the rows TRL's DPOTrainer reads "
            f"({len(bad)} of {len(prompt)} pairs are like it); train on the cache's masks with "
            "recipes/train_dpo.py"
        )
    in_prompt = pos < first[row]
    chosen_row = row % 2 == 0

    def lists(select: np.ndarray, counts: np.ndarray) -> pa.ListArray:
        offsets = np.zeros(len(counts) + 1, dtype=np.int32)
        np.cumsum(counts, out=offsets[1:])
        return pa.ListArray.from_arrays(offsets, got.tokens[select].astype(np.int64))

    table = pa.table({
        "prompt_ids": lists(in_prompt & chosen_row, prompt),
        "chosen_ids": lists(~in_prompt & chosen_row, lengths[0::2] - prompt),
        "rejected_ids": lists(~in_prompt & ~chosen_row, lengths[1::2] - prompt),
    })  # fmt: skip
    return Dataset(table)


class CachedPairsDPOTrainer(DPOTrainer):
    """``DPOTrainer`` that takes a dataset already holding ``prompt_ids`` as it is."""

    def _prepare_dataset(self, dataset: Any, processing_class: Any, args: Any, name: str) -> Any:
        if set(PAIR_COLUMNS) <= set(getattr(dataset, "column_names", None) or ()):
            return dataset
        return super()._prepare_dataset(dataset, processing_class, args, name)


def main(argv: list[str] | None = None) -> dict:
    """Train ``--max-steps`` DPO steps with TRL on the cache's pairs; returns the logged losses."""
    parser = argparse.ArgumentParser(description="TRL DPOTrainer on a preference cache's pairs")
    parser.add_argument("cache")
    parser.add_argument("tokenizer", help="the tokenizer the cache was built with (its pad id)")
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--max-steps", type=int, default=50)
    parser.add_argument("--batch-size", type=int, default=8, help="pairs per step")
    parser.add_argument("--beta", type=float, default=0.1)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--logging-steps", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--report", help="write the logged losses here (JSON)")
    args = parser.parse_args(argv)

    here = os.path.dirname(os.path.abspath(__file__))  # train_dpo.py beside this file
    spec = importlib.util.spec_from_file_location("train_dpo", os.path.join(here, "train_dpo.py"))
    train_dpo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train_dpo)

    dataset = trl_pairs(args.cache)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    cache = shardcache.open_cache(args.cache)
    vocab = int(cache.manifest["tokenizer"]["vocab_size"])
    longest = int(np.asarray(cache.lengths).max())
    model = train_dpo.tiny_model(vocab, args.hidden, max(longest, 64))
    config = DPOConfig(
        output_dir=args.output_dir,
        max_steps=args.max_steps,
        per_device_train_batch_size=args.batch_size,
        learning_rate=args.lr,
        beta=args.beta,
        max_length=None,  # the cache's max_length already bounds every side
        logging_steps=args.logging_steps,
        save_strategy="no",
        activation_checkpointing=False,  # TRL turns it on by default; a tiny model needs none
        report_to="none",
        seed=args.seed,
        use_cpu=not torch.cuda.is_available(),
    )
    reference = copy.deepcopy(model)  # TRL reloads a reference from the hub unless given one
    trainer = CachedPairsDPOTrainer(model=model, ref_model=reference, args=config,
                                    train_dataset=dataset, processing_class=tokenizer)  # fmt: skip
    trainer.train()
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    print(f"{args.max_steps} steps on {len(dataset)} pairs; logged losses {losses}", flush=True)
    report = {"losses": losses, "pairs": len(dataset)}
    if args.report:
        with open(args.report, "w", encoding="utf-8") as f:
            json.dump(report, f)
    return report


if __name__ == "__main__":
    main()
