"""ShardTrainer: transformers' ``Trainer`` fed by a ShardLoader, with per-token losses in chunks.

``Trainer`` builds its own ``DataLoader(dataset, batch_size=...)`` and hands it to accelerate,
whose dispatcher reads every batch on rank 0 and slices it across the ranks; a ``ShardDataset``
already gives every rank its own whole batches. ``ShardTrainer`` returns the ``ShardLoader``
from ``get_train_dataloader`` and reads an evaluation ``ShardDataset`` as it is. Its loss is
the model's token loss computed a chunk of positions at a time (``lm.causal_lm_target_logps``),
normalised as ``Trainer`` normalises the model's own loss, and its ``eval_loss`` is the mean over
every label token of the split on any number of processes.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader

from shardcache.errors import ConfigError
from shardcache.integrations.hf.lm import (
    causal_lm_target_logps,
    check_chunk_tokens,
    logits_to_keep_argument,
)
from shardcache.integrations.requirements import require
from shardcache.read.dataset import ShardDataset
from shardcache.read.loader import ShardLoader
from shardcache.read.losses import loss_sums, model_inputs, weighted_loss
from shardcache.read.trainer_callback import StallMonitorCallback

require("accelerate", "shardcache.integrations.hf.ShardTrainer (transformers' Trainer)")

from transformers import Trainer  # noqa: E402  (after the check that names the extra)
from transformers.modeling_outputs import CausalLMOutputWithPast  # noqa: E402


class ShardTrainer(Trainer):
    """transformers' ``Trainer`` that trains on a ``ShardLoader`` and evaluates per token.

    * Training reads ``shard_loader`` (what ``shardcache.loader(...)`` returns) as it is:
      ``get_train_dataloader`` returns it, so accelerate never re-splits its batches, and
      ``Trainer`` calls its ``set_epoch`` every epoch. The batch size is the loader's token
      budget; ``per_device_train_batch_size`` does not apply.
    * Evaluation reads ``eval_dataset`` (a ``ShardDataset``, usually ``eval=True`` over a
      ``split="validation"``) without accelerate's wrappers. ``eval_loss`` is the sum of the
      token losses of every label token on every process divided by their count
      (``eval_tokens``); with ``loss_weights`` the weighted mean (``eval_tokens``: the sum of
      the weights). Trainer's own figure averages batch means, which moves with the batching
      and the number of processes.
    * The loss is the model's mean token loss (or ``shardcache.weighted_loss`` when batches
      carry ``loss_weights``), computed from the model's last hidden states a chunk of
      ``chunk_tokens`` positions at a time, so no forward or backward holds the batch's whole
      logits; it is normalised as ``Trainer`` normalises the model's own loss (over
      ``num_items_in_batch`` with gradient accumulation and across devices).
    * A ``StallMonitorCallback`` is attached ahead of the reporters, so ``data_loading_pct``
      and the wait figures reach every training log (TensorBoard, W&B, ``log_history``).

    Args:
        *args: ``Trainer``'s positional arguments (``model``, ``args``, ...).
        shard_loader: the training batches (``shardcache.loader(...)``); its dataset becomes
            ``train_dataset``.
        chunk_tokens: positions whose logits are computed at once; None: sized from the
            vocabulary (128 MiB of float32 logits a chunk); 0: the model's whole logits and
            its own loss, as ``Trainer`` computes it (any model that returns a loss).
        stall_monitor: True: attach a new ``StallMonitorCallback``; a callback: attach that one;
            False: none. Attached ahead of the reporters; kept as ``self.stall_monitor``.
        **kwargs: ``Trainer``'s keyword arguments, except ``train_dataset``.

    Raises:
        ConfigError: ``train_dataset`` is given, ``shard_loader`` is not a ``ShardLoader``,
            ``chunk_tokens`` is invalid, the model cannot be chunked (it scales or caps its
            logits: pass ``chunk_tokens=0``), or ``compute_metrics`` /
            ``preprocess_logits_for_metrics`` need logits that chunks never hold whole.
        MissingDependencyError: accelerate (``Trainer``'s dependency) is not installed.
    """

    def __init__(
        self,
        *args: Any,
        shard_loader: ShardLoader,
        chunk_tokens: int | None = None,
        stall_monitor: bool | StallMonitorCallback = True,
        **kwargs: Any,
    ) -> None:
        if not isinstance(shard_loader, ShardLoader):
            raise ConfigError(
                f"ShardTrainer: shard_loader is a {type(shard_loader).__name__}; pass the "
                "ShardLoader that shardcache.loader(cache, max_tokens, ...) returns"
            )
        if "train_dataset" in kwargs:
            raise ConfigError(
                "ShardTrainer: train_dataset is given; the training batches are shard_loader's "
                "(its dataset becomes train_dataset), so leave train_dataset out"
            )
        check_chunk_tokens(chunk_tokens, "ShardTrainer")
        super().__init__(*args, train_dataset=shard_loader.dataset, **kwargs)
        self.shard_loader = shard_loader
        self.chunk_tokens = chunk_tokens
        self._token_loss: torch.Tensor | None = None  # (sum, weight) during an evaluation
        if chunk_tokens != 0:
            logits_to_keep_argument(self.model)
            wanted = [name for name in ("compute_metrics", "preprocess_logits_for_metrics")
                      if getattr(self, name, None) is not None]  # fmt: skip
            if wanted:
                raise ConfigError(
                    f"ShardTrainer: {' and '.join(wanted)} read(s) the model's logits, which "
                    f"chunk_tokens={chunk_tokens} never holds whole; pass chunk_tokens=0 to "
                    "evaluate with the whole logits"
                )
        self.stall_monitor: StallMonitorCallback | None = None
        if stall_monitor is not False:
            monitor = stall_monitor if stall_monitor is not True else StallMonitorCallback()
            if not isinstance(monitor, StallMonitorCallback):
                raise ConfigError(
                    f"ShardTrainer: stall_monitor is {stall_monitor!r}; pass True, False or a "
                    "shardcache.StallMonitorCallback"
                )
            self.stall_monitor = monitor.attach(self)

    def get_train_dataloader(self) -> Any:
        """The ``shard_loader`` as it is (Trainer moves each batch to the device itself).

        Returns:
            The ``ShardLoader`` given at construction.
        """
        return self.shard_loader

    def get_eval_dataloader(self, eval_dataset: Any = None) -> Any:
        """A ``ShardDataset``'s own batches, this rank's; anything else as ``Trainer`` reads it.

        Args:
            eval_dataset: the dataset to read (default: ``self.eval_dataset``).

        Returns:
            A ``DataLoader(dataset, batch_size=None)`` over a ``ShardDataset``, else
            ``Trainer``'s own evaluation dataloader.
        """
        data = eval_dataset if eval_dataset is not None else self.eval_dataset
        if isinstance(data, ShardDataset):
            return DataLoader(data, batch_size=None)
        return super().get_eval_dataloader(eval_dataset)

    def compute_loss(
        self,
        model: Any,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: Any = None,
    ) -> Any:
        """The batch's token loss (weighted with ``loss_weights``), a chunk at a time.

        Args:
            model: the model as ``Trainer`` passes it (DDP-wrapped under torchrun).
            inputs: a ``ShardDataset`` batch.
            return_outputs: also return an output holding the loss (no logits).
            num_items_in_batch: ``Trainer``'s count of label tokens over the accumulated
                micro-batches (and the processes); the unweighted loss is then the batch's
                token-loss sum over it, as the model's own loss would be.

        Returns:
            The loss, or ``(loss, outputs)`` with ``return_outputs``.
        """
        if self.chunk_tokens == 0:
            return self._model_loss(model, inputs, return_outputs, num_items_in_batch)
        logps = causal_lm_target_logps(model, inputs, self.chunk_tokens)
        total, weight = loss_sums(logps, inputs)
        tiny = torch.finfo(torch.float32).tiny
        scaled = self._scaled_for_accumulation(num_items_in_batch)
        if self._token_loss is not None:  # evaluation: the split's sums add up
            self._add_to_evaluation(total, weight)
            loss = total / weight.clamp(min=tiny)
        elif "loss_weights" in inputs:  # the batch's weighted mean
            loss = self._per_micro_batch(total / weight.clamp(min=tiny), scaled)
        elif scaled and num_items_in_batch is not None:  # as the model's own loss would be
            loss = total / torch.as_tensor(num_items_in_batch, device=total.device).clamp(min=1)
            if getattr(self.args, "average_tokens_across_devices", False):
                tp_size = getattr(self, "get_tp_size", lambda: 1)()
                processes = self.accelerator.num_processes // max(1, tp_size)
                loss = loss * (processes if self.args.n_gpu <= 1 else self.args.n_gpu)
        else:
            loss = total / weight.clamp(min=tiny)
        return (loss, CausalLMOutputWithPast(loss=loss)) if return_outputs else loss

    def _model_loss(
        self, model: Any, inputs: dict[str, Any], return_outputs: bool, num_items_in_batch: Any
    ) -> Any:
        """``chunk_tokens=0``: the loss of the model's whole logits (any model with a loss)."""
        if "loss_weights" in inputs:  # shardcache.weighted_loss of the logits
            feed = {k: v for k, v in model_inputs(inputs).items() if k != "labels"}
            outputs = model(**feed)
            loss = weighted_loss(outputs.logits, inputs)
            if self._token_loss is not None:
                weight = inputs["loss_weights"][..., 1:].float().sum()
                self._add_to_evaluation(loss.detach() * weight, weight)
            else:
                scaled = self._scaled_for_accumulation(num_items_in_batch)
                loss = self._per_micro_batch(loss, scaled)
            return (loss, outputs) if return_outputs else loss
        if self._token_loss is None:  # training: Trainer's own loss
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        # evaluation: the model's own mean over the batch's label tokens (a causal LM shifts
        # labels; no num_items_in_batch, which Trainer would scale by the processes), times
        # their count, is the batch's sum; an all-ignored filler batch adds nothing
        count = inputs["labels"][..., 1:].ne(-100).sum()
        loss, outputs = super().compute_loss(model, inputs, True, num_items_in_batch=None)
        self._add_to_evaluation(torch.where(count > 0, loss.detach() * count, 0.0), count)
        return (loss, outputs) if return_outputs else loss

    def _add_to_evaluation(self, total: torch.Tensor, weight: torch.Tensor) -> None:
        """Add a batch's loss sum and weight to the evaluation's (float64)."""
        assert self._token_loss is not None  # (called during an evaluation only)
        sums = torch.stack([total.detach().double(), weight.detach().double()])
        self._token_loss += sums.to(self._token_loss.device)

    def _per_micro_batch(self, loss: torch.Tensor, scaled: bool) -> torch.Tensor:
        """A weighted batch's mean, divided over the accumulated batches when Trainer won't."""
        if not scaled:  # Trainer divides it
            return loss
        steps = getattr(self, "current_gradient_accumulation_steps", None)
        return loss / (steps or self.args.gradient_accumulation_steps)

    def _scaled_for_accumulation(self, num_items_in_batch: Any) -> bool:
        """Whether Trainer takes the loss as already divided over the accumulated batches."""
        scaled = getattr(self, "loss_is_scaled_for_ga", None)
        if scaled is not None:
            return bool(scaled)
        accepts = getattr(self, "model_accepts_loss_kwargs", False)
        return bool(accepts and num_items_in_batch is not None) or (
            getattr(self, "compute_loss_func", None) is not None
        )

    def evaluation_loop(self, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.evaluation_loop``, then ``eval_loss`` / ``eval_tokens`` over every process.

        Args:
            *args: ``Trainer.evaluation_loop``'s positional arguments.
            **kwargs: its keyword arguments (``metric_key_prefix``: the metrics' prefix).

        Returns:
            Trainer's ``EvalLoopOutput`` with ``<prefix>_loss`` (the per-token mean over every
            process; NaN when the split has no label token) and ``<prefix>_tokens``.
        """
        self._token_loss = torch.zeros(2, dtype=torch.float64, device=self.args.device)
        try:
            output = super().evaluation_loop(*args, **kwargs)
            sums = self._token_loss
        finally:
            self._token_loss = None
        if self.args.world_size > 1:
            sums = self.accelerator.reduce(sums, reduction="sum")
        total, count = sums.tolist()
        prefix = kwargs.get("metric_key_prefix", args[4] if len(args) > 4 else "eval")
        output.metrics[f"{prefix}_loss"] = total / count if count else float("nan")
        output.metrics[f"{prefix}_tokens"] = int(count) if count == int(count) else count
        return output
