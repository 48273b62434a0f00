#!/usr/bin/env python3
"""Train a causal LM with transformers' ``Trainer`` reading packed batches from a shardcache cache.

    shardcache build recipes/quickstart.toml                      # -> quickstart-cache
    python recipes/train_hf_trainer.py quickstart-cache --output-dir out
    python recipes/train_hf_trainer.py quickstart-cache --output-dir out --validation 0.05
    torchrun --nproc_per_node 8 recipes/train_hf_trainer.py CACHE --output-dir out

Needs the ``train`` extra (``pip install -e ".[train]"``: accelerate, which ``Trainer`` needs).

What it shows: :class:`shardcache.integrations.hf.ShardTrainer` is ``Trainer`` with

* ``shard_loader=shardcache.loader(...)`` as its train dataloader (batches are token budgets,
  ``--max-tokens``; every rank reads its own under torchrun; accelerate never re-splits them);
* a held-out split (``--validation FRACTION``) as ``eval_dataset=ShardDataset(...,
  split="validation", eval=True)``, whose ``eval_loss`` is the per-token mean over every
  process;
* the loss computed from the model's last hidden states a chunk of positions at a time
  (``--chunk-tokens``, default sized from the vocabulary; 0: the model's whole logits), so a
  151k vocabulary does not take gigabytes of logits;
* ``StallMonitorCallback`` attached: ``data_loading_pct`` and the wait figures in every log.

``attention="mask"`` keeps packed documents apart with any attention implementation; with
``--attn flash_attention_2`` the recipe uses ``attention="varlen"``. The model is a small random
Qwen2 (``--vocab-size``: a larger vocabulary than the cache's, e.g. Qwen2's 151,936, to size
memory); what is measured is that Trainer consumes the batches and the loss falls.
``--report PATH`` writes the logged losses, the last log's data-loading figures and the
evaluation (JSON).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from typing import Any

import torch
from transformers import (
    PrinterCallback,
    Qwen2Config,
    Qwen2ForCausalLM,
    TrainerCallback,
    TrainingArguments,
)

import shardcache

try:
    from shardcache.integrations.hf import ShardTrainer
except shardcache.MissingDependencyError as err:  # accelerate: the train extra
    raise SystemExit(f"recipes/train_hf_trainer.py: {err}") from err

#: The data-loading figures the recipe reports from the last log (StallMonitorCallback).
MONITOR_KEYS = ("data_loading_pct", "data_loading_s", "wait_reader_s", "wait_copy_s")


class Progress(TrainerCallback):
    """One line per training log: step, loss, seconds per step, time waiting for data."""

    def __init__(self) -> None:
        self.started = time.perf_counter()

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        if not logs or "loss" not in logs or not state.is_world_process_zero:
            return
        step_s = (time.perf_counter() - self.started) / max(1, state.global_step)
        print(
            f"step {state.global_step}/{state.max_steps}: loss {logs['loss']:.4f} "
            f"({step_s:.2f} s/step, {logs.get('data_loading_pct', 0):.1f}% waiting for data)",
            flush=True,
        )


def tiny_model(vocab_size: int, hidden: int, max_positions: int, attn: str) -> torch.nn.Module:
    """A 2-layer random Qwen2 (from a config: nothing downloaded)."""
    heads = max(1, hidden // 32)
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
    )
    return Qwen2ForCausalLM._from_config(config, attn_implementation=attn)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description="transformers Trainer over a shardcache cache")
    parser.add_argument("cache")
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--max-steps", type=int, default=60)
    parser.add_argument("--max-tokens", type=int, default=2048, help="token budget per batch")
    parser.add_argument("--seq-len", type=int, default=512, help="packed row length")
    parser.add_argument("--attn", default="sdpa", help="attn_implementation of the model")
    parser.add_argument(
        "--num-workers",
        type=int,
        default=0,
        help="DataLoader workers (0: read in the training process)",
    )
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="the model's vocabulary (default: the cache's tokenizer's)",
    )
    parser.add_argument(
        "--chunk-tokens",
        type=int,
        default=None,
        help="positions whose logits are computed at once (default: sized from "
        "the vocabulary; 0: the model's whole logits)",
    )
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--logging-steps", type=int, default=10)
    parser.add_argument(
        "--validation",
        type=float,
        default=0.0,
        help="hold out this fraction of the documents and evaluate on it "
        "at the end (0: train on everything, no evaluation)",
    )
    parser.add_argument(
        "--report-to",
        default="none",
        help="Trainer's reporters, comma-separated (tensorboard, wandb, ...)",
    )
    parser.add_argument("--report", help="write the logged losses here (JSON)")
    args = parser.parse_args(argv)

    attention = "varlen" if args.attn.startswith("flash") else "mask"
    batches = {"mode": "pack", "seq_len": args.seq_len, "attention": attention}
    held_out: dict[str, Any] = {}
    if args.validation > 0:
        held_out = {"splits": shardcache.Split(validation=args.validation)}
    shard_loader = shardcache.loader(
        args.cache,
        args.max_tokens,
        seed=args.seed,
        num_workers=args.num_workers,
        **batches,
        **({"split": "train", **held_out} if held_out else {}),
    )
    eval_dataset = None
    if held_out:  # every held-out sequence once over all ranks, in a fixed order
        eval_dataset = shardcache.ShardDataset(
            args.cache, args.max_tokens, split="validation", eval=True, **held_out, **batches
        )
    vocab = int(shardcache.open_cache(args.cache).manifest["tokenizer"]["vocab_size"])
    if args.vocab_size is not None and args.vocab_size < vocab:
        parser.error(f"--vocab-size {args.vocab_size} is below the cache's vocabulary, {vocab}")
    torch.manual_seed(args.seed)
    model = tiny_model(args.vocab_size or vocab, args.hidden, args.seq_len, args.attn)
    training = TrainingArguments(
        output_dir=args.output_dir,
        max_steps=args.max_steps,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        logging_steps=args.logging_steps,
        logging_first_step=True,  # a first figure at once, and one even for --max-steps 1
        save_strategy="no",
        report_to=[] if args.report_to == "none" else args.report_to.split(","),
        seed=args.seed,
        use_cpu=not torch.cuda.is_available(),
        disable_tqdm=True,
    )
    trainer = ShardTrainer(
        model=model,
        args=training,
        shard_loader=shard_loader,
        eval_dataset=eval_dataset,
        chunk_tokens=args.chunk_tokens,
    )
    trainer.remove_callback(PrinterCallback)  # (its dicts): one line per log instead
    trainer.add_callback(Progress())
    if training.process_index == 0:
        print(
            f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters "
            f"(vocab {args.vocab_size or vocab}); {len(shard_loader)} batches of "
            f"{args.max_tokens} tokens per epoch; {args.max_steps} steps",
            flush=True,
        )
    result = trainer.train()
    if training.process_index == 0:  # what `shardcache rewind` recomputes any step's batches from
        accum = training.gradient_accumulation_steps
        path = shardcache.write_run_record(args.output_dir, shard_loader.dataset, grad_accum=accum)
        last = trainer.state.global_step - 1
        print(f"run record: {path}; the batches of the last step ({last}): "
              f"shardcache rewind {args.output_dir} --step {last}", flush=True)  # fmt: skip
    logged = [e for e in trainer.state.log_history if "loss" in e]
    losses = [float(e["loss"]) for e in logged]
    if not all(math.isfinite(x) for x in [*losses, result.training_loss]):
        raise SystemExit(f"the losses are not finite: logged {losses}, mean {result.training_loss}")
    print(
        f"{args.max_steps} steps; mean loss {result.training_loss:.4f}; "
        f"logged losses {[round(x, 4) for x in losses]}",
        flush=True,
    )
    data = {k: logged[-1][k] for k in MONITOR_KEYS if k in logged[-1]} if logged else {}
    print("data loading (last log): " + ", ".join(f"{k} {v:.4g}" for k, v in data.items()))
    # Trainer called set_epoch on the loader at every epoch: the dataset reshuffled each time
    report: dict[str, Any] = {
        "losses": losses,
        "train_loss": result.training_loss,
        "last_epoch": shard_loader.dataset.epoch,
        "data_loading": data,
    }
    if eval_dataset is not None:
        metrics = trainer.evaluate()
        report["eval"] = {k: metrics[k] for k in ("eval_loss", "eval_tokens")}
        print(f"eval_loss {metrics['eval_loss']:.4f} over {metrics['eval_tokens']} tokens")
    if args.report:
        with open(args.report, "w", encoding="utf-8") as f:
            json.dump(report, f)
    return report


if __name__ == "__main__":
    main()
    if torch.distributed.is_initialized():  # under torchrun: leave the group before exiting
        torch.distributed.destroy_process_group()
