"""A transformers causal LM's losses over shardcache batches, without its whole logits.

A causal LM's forward computes ``R x L x V`` logits; with a 151,936-entry vocabulary a
2,048-token batch's logits, their softmax and their gradient take gigabytes. Here the model runs
with ``logits_to_keep=1`` and ``output_hidden_states=True`` (through whatever wraps it, so DDP's
forward still prepares its gradient hooks), and ``shardcache.read.losses.target_logps`` applies
the output layer to the target positions a chunk at a time. Every call checks that the one
position the model scored itself equals the output layer applied to its last hidden state, so
a model that scales or caps its logits is refused rather than given another loss.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from shardcache.errors import ConfigError
from shardcache.read.collate.layout import IGNORE_INDEX
from shardcache.read.losses import (
    loss_sums,
    model_inputs,
    pair_logps_of_targets,
    target_logps,
)

#: Config fields by which a model scales or caps its logits after the output layer.
LOGIT_SCALING = (
    "final_logit_softcapping",
    "logit_scale",
    "logits_scaling",
    "output_multiplier",
    "lm_head_multiplier",
)


def check_chunk_tokens(chunk_tokens: int | None, where: str) -> None:
    """Raise ConfigError unless ``chunk_tokens`` is None or an int >= 0."""
    if chunk_tokens is not None and (
        isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 0
    ):
        raise ConfigError(
            f"{where}: chunk_tokens is {chunk_tokens!r}; use None (sized from the vocabulary), "
            "a number of positions >= 1, or 0 (the model's whole logits)"
        )


def logits_to_keep_argument(model: torch.nn.Module) -> str:
    """The keyword by which ``model`` scores only its last positions, after checking the model.

    Args:
        model: a transformers causal LM (wrapped in DDP or ``torch.compile``, or not).

    Returns:
        ``"logits_to_keep"`` (transformers >= 4.50) or ``"num_logits_to_keep"``.

    Raises:
        ConfigError: the model has no output layer to apply a chunk at a time, scales or caps
            its logits (a config field of ``LOGIT_SCALING``), or cannot be asked to score only
            its last positions; the message says to pass ``chunk_tokens=0``.
    """
    core = unwrap(model)
    name = type(core).__name__
    fix = "pass chunk_tokens=0 to take the loss of the model's whole logits"
    head = core.get_output_embeddings() if hasattr(core, "get_output_embeddings") else None
    weight = getattr(head, "weight", None)
    if not isinstance(head, torch.nn.Module) or not isinstance(weight, torch.Tensor):
        raise ConfigError(
            f"{name} has no output layer (get_output_embeddings() gave {type(head).__name__}), "
            f"so its loss cannot be computed a chunk of positions at a time; {fix}"
        )
    config = getattr(core, "config", None)
    get_text_config = getattr(config, "get_text_config", None)
    text = get_text_config() if callable(get_text_config) else config
    for field in LOGIT_SCALING:
        value = getattr(text, field, None)
        if value is not None and value != 1:
            raise ConfigError(
                f"{name} transforms its logits after the output layer (config.{field} = "
                f"{value!r}), so a loss over the output layer's chunks would not be its loss; "
                f"{fix}"
            )
    parameters = inspect.signature(core.forward).parameters
    for keyword in ("logits_to_keep", "num_logits_to_keep"):
        if keyword in parameters:
            return keyword
    raise ConfigError(
        f"{name}.forward takes neither logits_to_keep nor num_logits_to_keep, so it would compute "
        f"its whole logits anyway; {fix}"
    )


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The model inside DDP (``.module``) and ``torch.compile`` (``._orig_mod``) wrappers."""
    while True:
        inner = getattr(model, "module", None)
        if not isinstance(inner, torch.nn.Module):
            inner = getattr(model, "_orig_mod", None)
        if not isinstance(inner, torch.nn.Module):
            return model
        model = inner


def causal_lm_target_logps(
    model: torch.nn.Module, batch: dict[str, Any], chunk_tokens: int | None = None
) -> torch.Tensor:
    """The log-probability a causal LM gives every target of a batch, a chunk at a time.

    One forward of ``model`` over the batch's model inputs (``shardcache.model_inputs``, labels
    left out, ``use_cache=False``), scoring only the last position itself; then the output
    layer over the target positions, ``chunk_tokens`` at a time
    (``shardcache.read.losses.target_logps``: checkpointed chunks, so neither the forward nor
    the backward holds the batch's whole logits).

    Args:
        model: a transformers causal LM, or DDP / ``torch.compile`` around one; called as it
            is, so its wrappers' forward runs.
        batch: a ``ShardDataset`` batch (pad or pack mode) with its ``labels``.
        chunk_tokens: positions per chunk; None: sized from the vocabulary (128 MiB of float32
            logits a chunk); 0: the model's whole logits, one log-softmax over them (the
            reference the chunks equal).

    Returns:
        ``R x (L - 1)`` float32 log-probs: ``[r, t]`` of ``labels[r, t + 1]``, 0 where that
        label is -100.

    Raises:
        ConfigError: ``chunk_tokens`` is invalid; the model cannot be chunked (see
            ``logits_to_keep_argument``); the logits it gave for its last position are not
            its output layer applied to its last hidden state (it scales or caps them, or its
            output layer is sharded, as under FSDP): pass ``chunk_tokens=0``.
    """
    check_chunk_tokens(chunk_tokens, "causal_lm_target_logps")
    if not isinstance(batch, dict) or "labels" not in batch or "input_ids" not in batch:
        raise ConfigError(
            "causal_lm_target_logps: the batch has no input_ids and labels; pass a batch that "
            "ShardDataset yields"
        )
    labels = batch["labels"]
    inputs = {k: v for k, v in model_inputs(batch).items() if k != "labels"}
    if chunk_tokens == 0:
        logits = model(**inputs, use_cache=False).logits
        return _whole_logits_logps(logits, labels)
    keyword = logits_to_keep_argument(model)
    outputs = model(**inputs, use_cache=False, output_hidden_states=True, **{keyword: 1})
    hidden = outputs.hidden_states[-1]
    head = unwrap(model).get_output_embeddings()
    _check_head(model, head, hidden, outputs.logits)
    return target_logps(hidden, head, labels, chunk_tokens)


def causal_lm_loss(
    model: torch.nn.Module, batch: dict[str, Any], chunk_tokens: int | None = None
) -> torch.Tensor:
    """A causal LM's mean token loss over a batch, computed a chunk of positions at a time.

    The mean cross-entropy over the batch's targets (the model's own loss given ``labels``);
    with ``loss_weights`` in the batch (a cache built with ``--weight-field``), the weighted
    mean ``sum(w * token_loss) / sum(w)`` of ``shardcache.weighted_loss``.

    Args:
        model: a transformers causal LM (or DDP / ``torch.compile`` around one).
        batch: a ``ShardDataset`` batch with its ``labels``.
        chunk_tokens: as for ``causal_lm_target_logps`` (None: sized from the vocabulary;
            0: the whole logits).

    Returns:
        A float32 scalar (0, still differentiable, when the batch has no target).

    Raises:
        ConfigError: as ``causal_lm_target_logps``.
    """
    total, weight = loss_sums(causal_lm_target_logps(model, batch, chunk_tokens), batch)
    return total / weight.clamp(min=torch.finfo(torch.float32).tiny)


def causal_lm_pair_logps(
    model: torch.nn.Module, batch: dict[str, Any], chunk_tokens: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per pair of a preference batch, its completions' summed log-probs, a chunk at a time.

    ``shardcache.pair_logps`` of the model over the batch, without its whole logits: what a
    DPO-style loss compares.

    Args:
        model: a transformers causal LM (or DDP / ``torch.compile`` around one).
        batch: a batch of a preference cache (pad or pack mode).
        chunk_tokens: as for ``causal_lm_target_logps`` (None: sized from the vocabulary;
            0: the whole logits).

    Returns:
        ``(chosen, rejected)``: float32 tensors, entry ``k`` of both the batch's ``k``-th pair
        (as ``shardcache.pair_logps``).

    Raises:
        ConfigError: ``batch`` is not a preference batch, or as ``causal_lm_target_logps``.
    """
    return pair_logps_of_targets(causal_lm_target_logps(model, batch, chunk_tokens), batch)


def _whole_logits_logps(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``target_logps`` from whole ``R x L x V`` logits: one float32 log-softmax."""
    targets = labels.to(logits.device)[:, 1:]
    scored = logits[:, :-1].float()
    picked = scored.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    logps = picked - torch.logsumexp(scored, dim=-1)
    return torch.where(targets != IGNORE_INDEX, logps, 0.0)


def _check_head(
    model: torch.nn.Module, head: torch.nn.Module, hidden: torch.Tensor, logits: torch.Tensor
) -> None:
    """Refuse a model whose last-position logits are not ``head(last hidden state)``."""
    name = type(unwrap(model)).__name__
    fix = "pass chunk_tokens=0 to take the loss of the model's whole logits"
    weight = head.weight
    if weight.ndim != 2 or weight.shape[-1] != hidden.shape[-1]:
        raise ConfigError(
            f"{name}'s output layer has a weight of shape {tuple(weight.shape)} for hidden "
            f"states of size {hidden.shape[-1]} (a sharded model, as under FSDP or ZeRO-3?), "
            f"so it cannot be applied a chunk at a time outside the forward; {fix}"
        )
    with torch.no_grad():
        mine = head(hidden[:, -1]).float()
        theirs = logits[:, -1].float()
        gap = (mine - theirs).abs().max().item() if mine.numel() else 0.0
        scale = max(1.0, theirs.abs().max().item() if theirs.numel() else 0.0)
    if mine.shape != theirs.shape or not gap <= 1e-2 * scale:
        raise ConfigError(
            f"{name}'s logits are not its output layer applied to its last hidden state (at "
            f"the last position: shapes {tuple(theirs.shape)} and {tuple(mine.shape)}, largest "
            f"difference {gap:.4g}): it transforms them after the layer, so a loss over the "
            f"layer's chunks would not be its loss; {fix}"
        )
