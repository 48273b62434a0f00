#!/usr/bin/env python3
"""Train with TRL's ``DPOTrainer`` on the pairs of a preference cache, without tokenizing again.

    shardcache build recipes/dpo.toml
    python recipes/train_dpo_trl.py dpo-cache recipes/quickstart/tokenizer --output-dir out

Needs the ``train`` extra (``pip install -e ".[train]"``: trl, datasets, accelerate).

What it shows: ``shardcache.integrations.hf.trl_pairs(cache)`` is the cache's pairs as TRL's
rows of ``prompt_ids``, ``chosen_ids`` and ``rejected_ids``, and ``CachedPairsDPOTrainer`` is
``DPOTrainer`` taking those rows as they are (TRL's own ``DPOTrainer`` tokenizes every train
dataset again, and fails on rows without strings). TRL trains on whole completions, so a chat
pair whose template leaves untrained tokens after the answer is refused, with the pair named:
read such caches with ``recipes/train_dpo.py``, which uses the exact masks.

Batches are TRL's (``per_device_train_batch_size`` pairs, padded), not shardcache's token
budgets: use ``recipes/train_dpo.py`` to read pair batches with a token budget, exact resume
and ranks that never split a pair.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from typing import Any

import numpy as np
import torch
from transformers import (
    AutoTokenizer,
    PrinterCallback,
    Qwen2Config,
    Qwen2ForCausalLM,
    TrainerCallback,
)

import shardcache

try:
    from shardcache.integrations.hf import CachedPairsDPOTrainer, trl_pairs
except shardcache.MissingDependencyError as err:  # trl, datasets: the train extra
    raise SystemExit(f"recipes/train_dpo_trl.py: {err}") from err


class Progress(TrainerCallback):
    """One line per training log: step, loss, reward accuracy, seconds per step."""

    def __init__(self) -> None:
        self.started = time.perf_counter()

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        if not logs or "loss" not in logs or not state.is_world_process_zero:
            return
        step_s = (time.perf_counter() - self.started) / max(1, state.global_step)
        accuracy = logs.get("rewards/accuracies")
        shown = f", accuracy {accuracy:.2f}" if accuracy is not None else ""
        print(
            f"step {state.global_step}/{state.max_steps}: loss {logs['loss']:.4f}{shown} "
            f"({step_s:.2f} s/step)",
            flush=True,
        )


def main(argv: list[str] | None = None) -> dict:
    """Train ``--max-steps`` DPO steps with TRL on the cache's pairs; returns the logged losses."""
    parser = argparse.ArgumentParser(description="TRL DPOTrainer on a preference cache's pairs")
    parser.add_argument("cache")
    parser.add_argument("tokenizer", help="the tokenizer the cache was built with (its pad id)")
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--max-steps", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=8, help="pairs per step")
    parser.add_argument("--beta", type=float, default=0.1)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--logging-steps", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--report", help="write the logged losses here (JSON)")
    args = parser.parse_args(argv)
    from trl import DPOConfig  # (importable: the integration imported trl)

    dataset = trl_pairs(args.cache)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    cache = shardcache.open_cache(args.cache)
    vocab = int(cache.manifest["tokenizer"]["vocab_size"])
    longest = int(np.asarray(cache.lengths).max())
    torch.manual_seed(args.seed)
    heads = max(1, args.hidden // 32)
    model = Qwen2ForCausalLM._from_config(Qwen2Config(  # a 2-layer random Qwen2: no download
        vocab_size=vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
        num_hidden_layers=2, num_attention_heads=heads, num_key_value_heads=heads,
        max_position_embeddings=max(longest, 64), tie_word_embeddings=True,
    ))  # fmt: skip
    config = DPOConfig(
        output_dir=args.output_dir,
        max_steps=args.max_steps,
        per_device_train_batch_size=args.batch_size,
        learning_rate=args.lr,
        beta=args.beta,
        max_length=None,  # the cache's max_length already bounds every side
        logging_steps=args.logging_steps,
        logging_first_step=True,
        disable_tqdm=True,
        save_strategy="no",
        activation_checkpointing=False,  # TRL turns it on by default; a tiny model needs none
        report_to="none",
        seed=args.seed,
        use_cpu=not torch.cuda.is_available(),
    )
    reference = copy.deepcopy(model)  # TRL reloads a reference from the hub unless given one
    trainer = CachedPairsDPOTrainer(model=model, ref_model=reference, args=config,
                                    train_dataset=dataset, processing_class=tokenizer)  # fmt: skip
    trainer.remove_callback(PrinterCallback)  # (its dicts): one line per log instead
    trainer.add_callback(Progress())
    print(f"{len(dataset)} pairs from {args.cache}; {args.max_steps} steps of "
          f"{args.batch_size} pairs", flush=True)  # fmt: skip
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
