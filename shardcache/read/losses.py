"""What a training loop computes from a batch: model keyword arguments, pairs' log-probs.

And the per-token weighted loss of a cache with per-message loss weights. Each loss exists in
two forms that agree: from the model's whole ``R x L x V`` logits (``weighted_loss``,
``pair_logps``), and from the log-probs of the targets alone (``target_logps``: the output layer
applied to a chunk of positions at a time, so a 151k-vocabulary batch never holds its whole
logits, forward or backward; ``loss_sums``, ``pair_logps_of_targets``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.utils.checkpoint

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
    _require_pairs(batch, "pair_logps")
    labels = _labels_for(logits, batch, "pair_logps")
    device = logits.device
    targets = labels.to(device)[:, 1:]
    scored = logits[:, :-1].float()
    picked = scored.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return _pair_sums(picked - torch.logsumexp(scored, dim=-1), targets, batch)


#: Float32 logits one chunk of ``target_logps`` may hold by default: 128 MiB (220 tokens of a
#: 151,936-entry vocabulary, 8,192 of a 4,096-entry one). The backward holds about three such
#: buffers of the chunk it recomputes.
CHUNK_LOGITS_BYTES = 128 * 2**20


def chunk_tokens_for(vocab_size: int) -> int:
    """The default chunk of ``target_logps``: the tokens whose float32 logits fill 128 MiB."""
    return max(1, CHUNK_LOGITS_BYTES // (4 * max(1, vocab_size)))


def target_logps(
    hidden: torch.Tensor,
    head: Callable[[torch.Tensor], torch.Tensor],
    labels: torch.Tensor,
    chunk_tokens: int | None = None,
) -> torch.Tensor:
    """The log-probability of every target of a batch, never holding the batch's whole logits.

    The hidden state at position ``t`` scores the label at ``t + 1`` (a causal LM's shift).
    Only the positions whose next label is a target (not -100) go through ``head``, a chunk of
    ``chunk_tokens`` of them at a time; each chunk's log-softmax is float32. With gradients
    enabled each chunk runs under ``torch.utils.checkpoint`` (non-reentrant), so the forward
    keeps no chunk's logits and the backward recomputes one chunk at a time: the peak is about
    three chunks' float32 logits instead of three ``R x L x V`` tensors. The values (and the
    gradients through them) are those of the whole logits' log-softmax, to float32 rounding.

    Args:
        hidden: the model's last hidden states, ``R x L x D`` (after its final norm: what the
            output layer takes).
        head: the output layer, mapping ``N x D`` to ``N x V`` logits (a causal LM's
            ``get_output_embeddings()``).
        labels: the batch's ``R x L`` labels (-100 where no loss is taken).
        chunk_tokens: positions per chunk; None: ``chunk_tokens_for(V)`` (128 MiB of float32
            logits), V read from ``head.out_features`` or ``head.weight``.

    Returns:
        ``R x (L - 1)`` float32 log-probs on the device of ``hidden``: entry ``[r, t]`` is the
        log-probability of ``labels[r, t + 1]``, 0 where that label is -100.

    Raises:
        ConfigError: ``hidden`` and ``labels`` do not line up, or ``chunk_tokens`` < 1.
    """
    if hidden.ndim != 3 or tuple(hidden.shape[:2]) != tuple(labels.shape):
        raise ConfigError(
            f"target_logps: hidden states of shape {tuple(hidden.shape)} for labels of shape "
            f"{tuple(labels.shape)}; pass the model's last hidden states over this batch's "
            "input_ids (rows x length x hidden size)"
        )
    if chunk_tokens is None:
        chunk_tokens = chunk_tokens_for(_vocab_of(head))
    if chunk_tokens < 1:
        raise ConfigError(f"target_logps: chunk_tokens is {chunk_tokens}; use 1 or more")
    device = hidden.device
    rows, width = labels.shape
    targets = labels.to(device)[:, 1:].reshape(-1)
    at = torch.nonzero(targets != IGNORE_INDEX).squeeze(1)
    states = hidden[:, :-1].reshape(-1, hidden.shape[-1]).index_select(0, at)
    wanted = targets.index_select(0, at)
    recompute = torch.is_grad_enabled() and (
        states.requires_grad or any(p.requires_grad for p in _parameters(head))
    )
    pieces = []
    for start in range(0, len(at), chunk_tokens):
        chunk = (states[start : start + chunk_tokens], wanted[start : start + chunk_tokens])
        if recompute:
            pieces.append(torch.utils.checkpoint.checkpoint(
                _chunk_logps, head, *chunk, use_reentrant=False, preserve_rng_state=False
            ))  # fmt: skip
        else:
            pieces.append(_chunk_logps(head, *chunk))
    found = torch.cat(pieces) if pieces else states.new_zeros(0, dtype=torch.float32)
    out = torch.zeros(rows * (width - 1), dtype=torch.float32, device=device)
    return out.index_put((at,), found).view(rows, width - 1)


def loss_sums(logps: torch.Tensor, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch's summed token loss and the weight it is a mean over, from ``target_logps``.

    ``total = sum(w * -logp)`` over the batch's targets and ``weight = sum(w)``; ``w`` is the
    label's ``batch["loss_weights"]`` entry where the batch has them (``weighted_loss`` is
    ``total / weight``), else 1 on every target (``total / weight`` is a causal LM's own mean
    token loss).

    Args:
        logps: the ``R x (L - 1)`` log-probs of ``target_logps`` over ``batch``.
        batch: the batch (``labels``, and ``loss_weights`` when the cache has them).

    Returns:
        ``(total, weight)``: float32 scalars on the device of ``logps`` (``total`` carries
        the gradient).

    Raises:
        ConfigError: ``logps`` do not match the batch's labels.
    """
    targets = _targets_for(logps, batch, "loss_sums")
    valid = targets != IGNORE_INDEX
    if "loss_weights" in batch:
        weights = batch["loss_weights"].to(device=logps.device, dtype=torch.float32)[:, 1:]
        weights = torch.where(valid, weights, 0.0)
    else:
        weights = valid.float()
    return -(logps * weights).sum(), weights.sum()


def pair_logps_of_targets(
    logps: torch.Tensor, batch: dict[str, Any]
) -> tuple[torch.Tensor, torch.Tensor]:
    """``pair_logps`` of a preference batch from its ``target_logps`` instead of its logits.

    Args:
        logps: the ``R x (L - 1)`` log-probs of ``target_logps`` over ``batch``.
        batch: a batch of a preference cache (as for ``pair_logps``).

    Returns:
        ``(chosen, rejected)`` as ``pair_logps`` returns them (sums accumulated in float64).

    Raises:
        ConfigError: ``batch`` is not a batch of a preference cache, or ``logps`` do not match
            its labels.
    """
    _require_pairs(batch, "pair_logps_of_targets")
    return _pair_sums(logps, _targets_for(logps, batch, "pair_logps_of_targets"), batch)


def _chunk_logps(
    head: Callable[[torch.Tensor], torch.Tensor], states: torch.Tensor, wanted: torch.Tensor
) -> torch.Tensor:
    """One chunk's log-probs of its targets: float32 log-softmax of ``head(states)``, gathered."""
    scored = head(states).float()
    picked = scored.gather(-1, wanted.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(scored, dim=-1)


def _parameters(head: Callable[[torch.Tensor], torch.Tensor]) -> list[torch.Tensor]:
    return list(head.parameters()) if isinstance(head, torch.nn.Module) else []


def _vocab_of(head: Callable[[torch.Tensor], torch.Tensor]) -> int:
    """The vocabulary of an output layer (its ``out_features`` or its weight's rows)."""
    size = getattr(head, "out_features", None)
    if size is None and isinstance(getattr(head, "weight", None), torch.Tensor):
        size = head.weight.shape[0]
    if size is None:
        raise ConfigError(
            f"target_logps: cannot tell the vocabulary of the output layer {type(head).__name__} "
            "(no out_features, no weight); pass chunk_tokens"
        )
    return int(size)


def _require_pairs(batch: dict[str, Any], where: str) -> None:
    meta = batch.get("meta") if isinstance(batch, dict) else None
    if not isinstance(meta, dict) or "side" not in meta or "labels" not in batch:
        raise ConfigError(
            f"{where}: batch has no labels and meta['side']; pass a batch that "
            "ShardDataset yields over a preference cache (built with --preference)"
        )


def _targets_for(logps: torch.Tensor, batch: dict[str, Any], where: str) -> torch.Tensor:
    """The batch's targets (labels from position 1), checked against ``R x (L - 1)`` log-probs."""
    labels = batch["labels"]
    if logps.ndim != 2 or tuple(logps.shape) != (labels.shape[0], labels.shape[1] - 1):
        raise ConfigError(
            f"{where}: log-probs of shape {tuple(logps.shape)} for labels of shape "
            f"{tuple(labels.shape)}; pass target_logps over this batch (rows x (length - 1))"
        )
    return labels.to(logps.device)[:, 1:]


def _pair_sums(
    token_logps: torch.Tensor, targets: torch.Tensor, batch: dict[str, Any]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sequence, the float64 sum of its targets' log-probs, split into (chosen, rejected)."""
    device = token_logps.device
    rows, width = targets.shape[0], targets.shape[1] + 1
    meta = batch["meta"]
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
