#!/usr/bin/env python3
"""Train a causal LM with DPO on a preference cache: pair batches, a frozen reference model.

    shardcache build recipes/dpo.toml                       # 591 bundled pairs -> dpo-cache
    python recipes/train_dpo.py dpo-cache --steps 50
    python recipes/train_dpo.py dpo-cache --steps 30 --save-state reader.json   # stop ...
    python recipes/train_dpo.py dpo-cache --steps 20 --resume reader.json       # ... continue
    python recipes/train_dpo.py dpo-cache --overfit-batch --steps 20   # sanity check

What it shows (copy it):

* ``ShardDataset(cache, max_tokens)`` on a preference cache (pad mode): rows ``2j`` and
  ``2j + 1`` of a batch are pair ``j``'s chosen and rejected sequence (prompt + completion),
  ``labels`` hold the completion tokens and ``-100`` on the prompt and the padding;
* :func:`sequence_logps`: per row, the sum of the log-probabilities of the completion tokens
  (the model's own shifted targets: logits at ``t`` score ``labels[t + 1]``);
* the reference model is a frozen copy of the policy at step 0: its log-probs are computed
  once per batch, under ``torch.no_grad()``, before the policy's forward;
* :func:`dpo_loss`: the sigmoid DPO loss ``-log sigmoid(beta * ((pi_c - ref_c) - (pi_r -
  ref_r)))`` averaged over the batch's pairs, as TRL's ``DPOTrainer`` computes it
  (``loss_type="sigmoid"``; tests/test_dpo_trl.py checks the two agree on the same records).

At step 0 the policy is the reference, so the loss is ``ln 2`` for every pair; it falls as the
policy learns to prefer the chosen side. The model is a small random Qwen2 or Llama sized from
the cache's vocabulary: a stand-in, what is measured is the loss and the reward accuracy.
``--report PATH`` writes per-step losses, accuracies and the pair ids of every batch (JSON).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import time
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

import shardcache

IGNORE_INDEX = -100


def tiny_model(
    vocab_size: int,
    hidden: int = 64,
    max_positions: int = 1024,
    arch: str = "qwen2",
    attn_implementation: str = "sdpa",
) -> torch.nn.Module:
    """A 2-layer random Qwen2 or Llama (from a config: nothing downloaded)."""
    heads = max(1, hidden // 32)
    common = {
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "num_hidden_layers": 2,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "max_position_embeddings": max_positions,
        "tie_word_embeddings": True,
    }
    if arch == "qwen2":
        return Qwen2ForCausalLM._from_config(Qwen2Config(**common),
                                             attn_implementation=attn_implementation)  # fmt: skip
    if arch == "llama":
        return LlamaForCausalLM._from_config(LlamaConfig(**common),
                                             attn_implementation=attn_implementation)  # fmt: skip
    raise SystemExit(f"--arch: got {arch!r}; use qwen2 or llama")


def sequence_logps(model: torch.nn.Module, batch: dict[str, Any]) -> torch.Tensor:
    """Per row, the summed log-probability of its completion tokens (``labels != -100``).

    The logits at position ``t`` predict token ``t + 1``, so row ``r``'s sum is over the
    positions ``t`` with ``labels[r, t + 1] != -100``; the prompt and the padding add nothing.
    """
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                   use_cache=False).logits[:, :-1].float()  # fmt: skip
    targets = batch["labels"][:, 1:]
    keep = targets != IGNORE_INDEX
    token_logps = torch.gather(
        logits.log_softmax(-1), 2, targets.clamp(min=0).unsqueeze(-1)
    ).squeeze(-1)
    return (token_logps * keep).sum(-1)


def dpo_loss(
    policy: torch.Tensor, reference: torch.Tensor, beta: float
) -> tuple[torch.Tensor, dict[str, float]]:
    """The sigmoid DPO loss of pair rows (``2j`` chosen, ``2j + 1`` rejected), mean over pairs.

    Returns the loss and the batch's metrics: ``accuracy`` (pairs whose chosen reward beats
    the rejected one) and ``margin`` (mean chosen minus rejected reward, ``beta`` times the
    log-ratios).
    """
    chosen = policy[0::2] - reference[0::2]
    rejected = policy[1::2] - reference[1::2]
    delta = chosen - rejected
    loss = -F.logsigmoid(beta * delta).mean()
    with torch.no_grad():
        metrics = {
            "accuracy": (delta > 0).float().mean().item(),
            "margin": (beta * delta).mean().item(),
        }
    return loss, metrics


def check_pairs(batch: dict[str, Any]) -> None:
    """Rows alternate chosen, rejected of the same pair (what ``dpo_loss`` relies on)."""
    meta = batch["meta"]
    side, pairs = meta["side"], meta["pair_ids"]
    if len(side) % 2 or (side[0::2] != 0).any() or (side[1::2] != 1).any():
        raise SystemExit("batch rows are not chosen/rejected pairs: is the cache a preference one?")
    if (pairs[0::2] != pairs[1::2]).any():
        raise SystemExit("batch rows 2j and 2j + 1 belong to different pairs")


def main(argv: list[str] | None = None) -> dict:
    """Run DPO on a preference cache; returns losses, accuracies, pair ids and reader state."""
    parser = argparse.ArgumentParser(description="DPO over a shardcache preference cache")
    parser.add_argument("cache")
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps to run")
    parser.add_argument("--max-tokens", type=int, default=4096, help="token budget per batch")
    parser.add_argument("--beta", type=float, default=0.1)
    parser.add_argument("--arch", choices=["qwen2", "llama"], default="qwen2")
    parser.add_argument("--num-workers", type=int, default=0)
    parser.add_argument("--device", default=None, help="default: cuda when present, else cpu")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--resume", help="reader state JSON written by --save-state")
    parser.add_argument("--save-state", help="write the reader state after the last step")
    parser.add_argument(
        "--overfit-batch", action="store_true", help="train on the first batch over and over"
    )
    parser.add_argument("--report", help="write losses and consumed pair ids here (JSON)")
    args = parser.parse_args(argv)

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.manual_seed(args.seed)
    cache = shardcache.open_cache(args.cache)
    if not cache.is_preference:
        raise SystemExit(f"{args.cache}: not a preference cache (build it with --preference)")
    loader = shardcache.loader(
        args.cache, args.max_tokens, seed=args.seed, num_workers=args.num_workers, device=device
    )
    if args.resume:
        with open(args.resume, encoding="utf-8") as f:
            loader.load_state_dict(json.load(f))
    vocab = int(cache.manifest["tokenizer"]["vocab_size"])
    longest = int(np.asarray(cache.lengths).max())
    policy = tiny_model(vocab, args.hidden, max(longest, 64), args.arch).to(device).train()
    reference = copy.deepcopy(policy).eval().requires_grad_(False)  # frozen, the step-0 policy
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.lr)
    print(
        f"model: {sum(p.numel() for p in policy.parameters()) / 1e6:.1f}M parameters "
        f"({args.arch}, vocab {vocab}); {cache.num_sequences // 2} pairs, "
        f"{len(loader)} batches per epoch; beta {args.beta}",
        flush=True,
    )

    losses: list[float] = []
    accuracies: list[float] = []
    consumed: list[list[int]] = []
    reference_forwards = 0
    epoch, step, started = loader.dataset.epoch, 0, time.perf_counter()
    first: tuple[dict[str, Any], torch.Tensor] | None = None
    with loader:
        while step < args.steps:
            loader.set_epoch(epoch)
            for batch in loader:
                if args.overfit_batch and first is not None:
                    batch, ref_logps = first  # the reference log-probs of the batch, kept
                else:
                    check_pairs(batch)
                    with torch.no_grad():  # once per batch: the reference never changes
                        ref_logps = sequence_logps(reference, batch)
                    reference_forwards += 1
                    first = first if first is not None else (batch, ref_logps)
                loss, metrics = dpo_loss(sequence_logps(policy, batch), ref_logps, args.beta)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                losses.append(loss.item())
                accuracies.append(metrics["accuracy"])
                consumed.append(batch["meta"]["pair_ids"][0::2].tolist())
                step += 1
                if not math.isfinite(losses[-1]):
                    raise SystemExit(f"step {step}: loss is {losses[-1]}")
                if step % args.log_every == 0 or step == args.steps:
                    rate = step / (time.perf_counter() - started)
                    print(f"epoch {epoch} step {step}: loss {losses[-1]:.4f} accuracy "
                          f"{metrics['accuracy']:.2f} margin {metrics['margin']:.3f} "
                          f"({rate:.1f} steps/s)", flush=True)  # fmt: skip
                if step == args.steps:
                    break
            else:
                epoch += 1
        state = loader.state_dict()  # exact: counts only the batches trained on
    if args.save_state:
        with open(args.save_state, "w", encoding="utf-8") as f:
            json.dump(state, f)
    report = {
        "losses": losses,
        "accuracies": accuracies,
        "pairs": consumed,
        "reference_forwards": reference_forwards,
        "state": state,
    }
    if args.report:
        with open(args.report, "w", encoding="utf-8") as f:
            json.dump(report, f)
    return report


if __name__ == "__main__":
    main()
