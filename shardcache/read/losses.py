"""What a training loop computes from a batch: model keyword arguments, pairs' log-probs.

And the per-token weighted loss of a cache with per-message loss weights.
"""

from __future__ import annotations

from typing import Any

import torch

from shardcache.errors import ConfigError
from shardcache.read.collate.layout import IGNORE_INDEX


def model_inputs(batch: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments of a model that rejects unknown ones.

    Args:
        batch: a batch of [`ShardDataset`][shardcache.ShardDataset].

    Returns:
        A new dict: ``batch`` without its ``"meta"`` and ``"loss_weights"`` (no model takes
        them: a weighted cache's loss is ``weighted_loss`` of the model's logits).
    """
    return {k: v for k, v in batch.items() if k not in NOT_MODEL_INPUTS}


#: Batch keys that are not model keyword arguments.
NOT_MODEL_INPUTS = ("meta", "loss_weights")


def weighted_loss(logits: torch.Tensor, batch: dict[str, Any]) -> torch.Tensor:
    """The per-token weighted cross-entropy of a batch of a cache with loss weights.

    ``sum(w * token_loss) / sum(w)`` over every target of the batch: the logits at position
    ``t`` score the label at ``t + 1`` (as a causal LM's own loss), ``w`` is the label's entry of
    ``batch["loss_weights"]`` (0 wherever the label is -100: padding, prompts, weight-0
    messages, a packed segment's first token). With every weight 1 it is the model's own mean
    token loss; it is the same whatever the rows hold (pad or pack, any batching), so the loss of
    a batch equals the weighted sum of its sequences' token losses over their weights.

    Args:
        logits: the model's ``R x L x V`` logits over ``batch["input_ids"]`` (any float dtype;
            reduced in float32).
        batch: a batch with ``labels`` and ``loss_weights`` (``ShardDataset`` over a cache built
            with ``--weight-field``).

    Returns:
        A float32 scalar on the device of ``logits`` (0, still differentiable, when the batch
        has no weight).

    Raises:
        ConfigError: ``batch`` has no ``loss_weights``, or ``logits`` do not match its labels.
    """
    if not isinstance(batch, dict) or "loss_weights" not in batch or "labels" not in batch:
        raise ConfigError(
            "weighted_loss: the batch has no loss_weights; pass a batch that ShardDataset "
            "yields over a cache built with --weight-field (else use the model's own loss)"
        )
    labels = _labels_for(logits, batch, "weighted_loss")
    device = logits.device
    targets = labels.to(device)[:, 1:]
    weights = batch["loss_weights"].to(device=device, dtype=torch.float32)[:, 1:]
    weights = torch.where(targets != IGNORE_INDEX, weights, 0.0)
    token_loss = torch.nn.functional.cross_entropy(
        logits[:, :-1].float().flatten(0, 1),
        targets.clamp(min=0).flatten(),
        reduction="none",
    )
    total = (token_loss * weights.flatten()).sum()
    return total / weights.sum().clamp(min=torch.finfo(torch.float32).tiny)


def pair_logps(logits: torch.Tensor, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per pair of a preference batch, the summed log-probabilities of its two completions.

    What a DPO-style loss compares: for every sequence of the batch, the sum over its target
    tokens (labels other than -100: the completion, never the prompt or padding) of the
    log-probability the model gave it, the logits at position ``t`` scoring the label at
    ``t + 1`` of the same sequence. Pad mode: a sequence per row; pack mode: a segment of
    ``meta["cu_seqlens"]`` (a row's padding is a segment of no pair).

    Args:
        logits: the model's ``R x L x V`` logits over ``batch["input_ids"]`` (any float dtype;
            each token's log-softmax in float32, the sum accumulated in float64).
        batch: a batch of a preference cache from [`ShardDataset`][shardcache.ShardDataset],
            pad or pack mode, with its ``labels`` and ``meta`` (``pair_ids``, ``side``).

    Returns:
        ``(chosen, rejected)``: float32 tensors with one value per pair of the batch, on the
        device of ``logits``; entry ``k`` of both is the batch's ``k``-th pair, whose id is
        the ``k``-th ``meta["pair_ids"]`` entry with ``meta["side"]`` 0. Each value is within
        one float32 ulp of its sum (``1.2e-7 * |sum|``) of the float64 sum of the float32
        logits' log-probs: the per-token log-softmax is float32, the accumulation float64.

    Raises:
        ConfigError: ``batch`` is not a batch of a preference cache, or ``logits`` do not match
            its ``labels``.
    """
    meta = batch.get("meta") if isinstance(batch, dict) else None
    if not isinstance(meta, dict) or "side" not in meta or "labels" not in batch:
        raise ConfigError(
            "pair_logps: batch has no labels and meta['side']; pass a batch that "
            "ShardDataset yields over a preference cache (built with --preference)"
        )
    labels = _labels_for(logits, batch, "pair_logps")
    device = logits.device
    rows, width = labels.shape
    targets = labels.to(device)[:, 1:]
    scored = logits[:, :-1].float()
    picked = scored.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    token_logps = picked - torch.logsumexp(scored, dim=-1)
    valid = targets != IGNORE_INDEX
    side = meta["side"].to(device)
    if "cu_seqlens" in meta:  # pack mode: the segment of every target's flat position
        at = (
            torch.arange(1, width, device=device)
            + width * torch.arange(rows, device=device)[:, None]
        )
        cu = meta["cu_seqlens"].to(device=device, dtype=torch.int64)
        segment = torch.searchsorted(cu, at, right=True) - 1
    else:  # pad mode: a row per sequence
        segment = torch.arange(rows, device=device)[:, None].expand(rows, width - 1)
    # each token's log-prob is a float32 difference; their sum is accumulated in float64 (not
    # float32, which loses a few ulps of a sum of thousands) where the device has float64
    wide = device if device.type != "mps" else torch.device("cpu")
    sums = torch.zeros(len(side), dtype=torch.float64, device=wide)
    sums.index_add_(0, segment[valid].to(wide), token_logps[valid].to(wide, torch.float64))
    sums = sums.to(device=device, dtype=torch.float32)
    return sums[side == 0], sums[side == 1]


def _labels_for(logits: torch.Tensor, batch: dict[str, Any], where: str) -> torch.Tensor:
    """The batch's labels, checked against the ``R x L x V`` logits (ConfigError)."""
    labels = batch["labels"]
    if logits.ndim != 3 or tuple(logits.shape[:2]) != tuple(labels.shape):
        raise ConfigError(
            f"{where}: logits of shape {tuple(logits.shape)} for labels of shape "
            f"{tuple(labels.shape)}; pass the model's logits over this batch's input_ids "
            "(rows x length x vocabulary)"
        )
    return labels
