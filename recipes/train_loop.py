#!/usr/bin/env python3
"""Train a causal LM with a plain loop: ``shardcache.loader`` + ``DevicePrefetcher`` + resume.

    python recipes/train_loop.py CACHE --steps 200
    python recipes/train_loop.py CACHE --steps 100 --save-state reader.json   # stop ...
    python recipes/train_loop.py CACHE --steps 100 --resume reader.json       # ... continue
    python recipes/train_loop.py CACHE --overfit-batch --steps 20             # sanity check

What it shows (copy it):

* ``shardcache.loader(cache, max_tokens, mode="pack", seq_len=..., attention="mask",
  device=...)``: packed rows of ``seq_len`` tokens, each document attending to itself only
  (``attention="mask"``: a 4-D block-causal mask, exact with sdpa and eager; use
  ``attention="varlen"`` with ``attn_implementation="flash_attention_2"``), DataLoader workers
  started safely, batches moved to the device ahead of the step;
* ``model(**shardcache.model_inputs(batch))``: the batch's ``meta`` (sample ids) stays out of
  the model call; the loss is the model's own (labels are -100 on padding and on each
  document's first token, so it is the token-weighted mean of the per-document losses); a
  cache built with ``--weight-field`` (per-message loss weights) gives batches a
  ``loss_weights`` tensor, and :func:`batch_loss` takes ``shardcache.weighted_loss`` of the
  logits instead: ``sum(w * token_loss) / sum(w)`` over the batch;
* ``shardcache.StallMonitor`` around the loader: every step's data-loading figures (the wait
  for ``next()``, split into the reader and the copy, and the reader's stage times), printed
  with the progress (the share of the steps since the last print spent waiting) and written
  to TensorBoard with ``--tensorboard DIR`` (torch's ``SummaryWriter``; needs tensorboard);
* ``loader.state_dict()`` after ``k`` steps is exact although workers and the prefetcher read
  ahead: ``--resume`` continues with exactly the batches not yet trained on.

The model is a small random Qwen2 sized from the cache's vocabulary (``--hidden``, 2 layers);
it is a stand-in: what is measured is that the loss falls and the stream resumes exactly.
``--report PATH`` writes the per-step losses, data-loading figures and the sample ids of every
batch (JSON).
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

import shardcache


def tiny_model(vocab_size: int, hidden: int, max_positions: int) -> Qwen2ForCausalLM:
    """A 2-layer random Qwen2. The embedding (vocab x hidden, tied with the output) dominates
    its size: keep ``hidden`` small for a 150k vocabulary (64 -> 10M parameters)."""
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
    return Qwen2ForCausalLM._from_config(config, attn_implementation="sdpa")


def batch_loss(model: torch.nn.Module, batch: dict, **kwargs: object) -> torch.Tensor:
    """The model's own loss, or the per-token weighted loss of a batch with ``loss_weights``."""
    inputs = shardcache.model_inputs(batch)
    if "loss_weights" not in batch:
        return model(**inputs, **kwargs).loss
    inputs.pop("labels")  # the model's unweighted loss is not needed
    return shardcache.weighted_loss(model(**inputs, **kwargs).logits, batch)


def waiting(figures: list[dict[str, float]]) -> str:
    """The share of these steps spent waiting for data, and where the reader spent its time."""
    step_s = sum(f["step_s"] for f in figures)
    loading = sum(f["data_loading_s"] for f in figures)
    stages = {s: sum(f[s + "_s"] for f in figures) for s in ("fetch", "gather", "collate")}
    where = ", ".join(f"{s} {1e3 * v / len(figures):.2f} ms" for s, v in stages.items())
    return f"waited for data {100 * loading / max(step_s, 1e-9):.1f}% of the time; {where}/step"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description="plain training loop over a shardcache cache")
    parser.add_argument("cache")
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps to run")
    parser.add_argument("--max-tokens", type=int, default=4096, help="token budget per batch")
    parser.add_argument("--seq-len", type=int, default=1024, help="packed row length")
    parser.add_argument("--attention", choices=["mask", "varlen", "none"], default="mask")
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--device", default=None, help="default: cuda when present, else cpu")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--resume", help="reader state JSON written by --save-state")
    parser.add_argument("--save-state", help="write the reader state after the last step")
    parser.add_argument(
        "--overfit-batch", action="store_true", help="train on the first batch over and over"
    )
    parser.add_argument("--report", help="write losses and consumed sample ids here (JSON)")
    parser.add_argument("--tensorboard", help="write the data-loading figures here (a log dir)")
    args = parser.parse_args(argv)

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.manual_seed(args.seed)
    loader = shardcache.loader(
        args.cache,
        args.max_tokens,
        mode="pack",
        seq_len=args.seq_len,
        attention=args.attention,
        seed=args.seed,
        num_workers=args.num_workers,
        device=device,
    )
    if args.resume:
        with open(args.resume, encoding="utf-8") as f:
            loader.load_state_dict(json.load(f))
    vocab = int(shardcache.open_cache(args.cache).manifest["tokenizer"]["vocab_size"])
    model = tiny_model(vocab, args.hidden, args.seq_len).to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    print(
        f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters "
        f"(vocab {vocab}); {len(loader)} batches per epoch; attention={args.attention}",
        flush=True,
    )
    use_cache = {"use_cache": False} if args.attention != "mask" else {}
    writer = None
    if args.tensorboard:
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(args.tensorboard)
    monitor = shardcache.StallMonitor(writer, prefix="data/")

    losses: list[float] = []
    consumed: list[list[int]] = []
    loading: list[dict[str, float]] = []
    epoch, step, started = loader.dataset.epoch, 0, time.perf_counter()
    first = None
    with loader:
        while step < args.steps:
            loader.set_epoch(epoch)  # the resumed epoch keeps its position
            for batch in monitor.wrap(loader):
                if args.overfit_batch:
                    first = first if first is not None else batch
                    batch = first
                loss = batch_loss(model, batch, **use_cache)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                losses.append(loss.item())
                consumed.append(batch["meta"]["sample_ids"].tolist())
                loading.append(monitor.step(step))  # a dict for any logger
                step += 1
                if not math.isfinite(losses[-1]):
                    raise SystemExit(f"step {step}: loss is {losses[-1]}")
                if step % args.log_every == 0 or step == args.steps:
                    rate = step / (time.perf_counter() - started)
                    print(f"epoch {epoch} step {step}: loss {losses[-1]:.4f} ({rate:.1f} steps/s; "
                          f"{waiting(loading[-args.log_every:])})", flush=True)  # fmt: skip
                if step == args.steps:
                    break
            else:
                epoch += 1  # the pass ended: next epoch
        state = loader.state_dict()  # exact: counts only the batches trained on
    if writer is not None:
        writer.close()
    if args.save_state:
        with open(args.save_state, "w", encoding="utf-8") as f:
            json.dump(state, f)
    report = {"losses": losses, "batches": consumed, "state": state, "data_loading": loading}
    if args.report:
        with open(args.report, "w", encoding="utf-8") as f:
            json.dump(report, f)
    return report


if __name__ == "__main__":
    main()
