"""StallMonitorCallback: the StallMonitor's figures in transformers' ``Trainer`` logs.

``Trainer`` iterates its train dataloader itself, so the monitor cannot wrap it from outside:
the callback hands its monitor to the ``ShardLoader`` that ``get_train_dataloader`` returned
(``ShardLoader.monitor``; its passes then go through ``StallMonitor.wrap``), closes a monitor
step at every optimizer step, and at every log adds the figures since the previous log to the
Trainer's ``logs``. transformers is never imported here: a Trainer calls its callbacks by event
name, and every event this class does not define is a no-op.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from shardcache.errors import ConfigError
from shardcache.read.device_prefetch.monitor import StallMonitor, over_ranks
from shardcache.read.loader import ShardLoader

#: Figures added to the logs as means per step since the previous log (seconds).
MEAN_FIGURES = (
    "step_s",
    "data_loading_s",
    "wait_reader_s",
    "wait_copy_s",
    "plan_s",
    "fetch_s",
    "gather_s",
    "collate_s",
    "pin_s",
    "copy_s",
)


def _no_op(*args: Any, **kwargs: Any) -> None:
    return None


class StallMonitorCallback:
    """A transformers ``Trainer`` callback that logs where each step waited for data.

    The Trainer's train dataloader must be a [`ShardLoader`][shardcache.ShardLoader] (what
    ``shardcache.loader(...)`` returns; ``shardcache.integrations.hf.ShardTrainer`` returns it
    from ``get_train_dataloader``). At every optimizer step the callback closes a step of its
    [`StallMonitor`][shardcache.StallMonitor]; at every training log (one with ``loss`` or
    ``train_loss``, not an evaluation's) it adds, over the steps since the previous one:
    ``data_loading_pct`` (percent of the steps' time in the loader's ``next()``), the means
    per step of ``step_s``, ``data_loading_s``, ``wait_reader_s``, ``wait_copy_s`` and the
    stage times (``plan_s`` ... ``copy_s``), and with ``ranks`` and more than one
    process ``data_loading_max_s`` / ``data_loading_min_s`` (the mean wait per step of the
    slowest and the fastest rank: one all-reduce per log, on every rank, as Trainer logs on
    every rank). The figures reach ``trainer.state.log_history`` and the callbacks after this
    one; transformers' reporters (TensorBoard, W&B, ...) come before the callbacks given to
    ``Trainer(callbacks=...)``, so put it ahead of them with ``attach``::

        trainer = ShardTrainer(model=model, args=args, shard_loader=shard_loader)
        StallMonitorCallback().attach(trainer)

    Args:
        writer: also write every step's figures to this TensorBoard ``SummaryWriter`` (see
            ``StallMonitor``), or None.
        ranks: add the max and min over the ranks when ``torch.distributed`` is initialized
            with more than one process.
        warn_pct: the monitor's stall warning threshold (``StallMonitor``; None: no warning).

    Raises:
        ConfigError: a value is invalid (see ``StallMonitor``); at the start of training, the
            train dataloader is not a ``ShardLoader``.
    """

    def __init__(
        self, writer: Any = None, *, ranks: bool = True, warn_pct: float | None = 10.0
    ) -> None:
        self.monitor = StallMonitor(writer, ranks=False, warn_pct=warn_pct)
        self.ranks = ranks
        self._window: dict[str, float] = {}
        self._steps = 0
        self._loader: ShardLoader | None = None

    def attach(self, trainer: Any) -> StallMonitorCallback:
        """Put this callback first among ``trainer``'s callbacks, ahead of its reporters.

        Args:
            trainer: a transformers ``Trainer``.

        Returns:
            This callback.
        """
        callbacks = trainer.callback_handler.callbacks
        if self in callbacks:
            callbacks.remove(self)
        callbacks.insert(0, self)
        return self

    def __getattr__(self, name: str) -> Callable[..., None]:
        if name.startswith("on_"):  # every Trainer event this class does not handle
            return _no_op
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Hand the monitor to the train dataloader (a ``ShardLoader``).

        Args:
            args: the Trainer's ``TrainingArguments``.
            state: its ``TrainerState`` (``global_step``, ``log_history``).
            control: its ``TrainerControl``.
            **kwargs: the rest of the event's arguments (``train_dataloader`` is read).

        Raises:
            ConfigError: the train dataloader is not a ``ShardLoader``.
        """
        loader = kwargs.get("train_dataloader")
        if not isinstance(loader, ShardLoader):
            raise ConfigError(
                f"StallMonitorCallback: the Trainer's train dataloader is a "
                f"{type(loader).__name__}, not a shardcache.ShardLoader, so the wait for its "
                "batches cannot be timed. Return shardcache.loader(...) from "
                "get_train_dataloader (shardcache.integrations.hf.ShardTrainer does)"
            )
        loader.monitor = self.monitor
        self._loader = loader
        self._window, self._steps = {}, 0

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Close a monitor step (every optimizer step, after its micro-batches).

        Args:
            args: the Trainer's ``TrainingArguments``.
            state: its ``TrainerState`` (``global_step``, ``log_history``).
            control: its ``TrainerControl``.
            **kwargs: the rest of the event's arguments.
        """
        for name, value in self.monitor.step(state.global_step).items():
            self._window[name] = self._window.get(name, 0.0) + value
        self._steps += 1

    def on_log(
        self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any
    ) -> None:
        """Add the figures since the previous training log to ``logs`` and its history entry.

        Args:
            args: the Trainer's ``TrainingArguments``.
            state: its ``TrainerState`` (``global_step``, ``log_history``).
            control: its ``TrainerControl``.
            logs: the figures being logged; the monitor's are added in place.
            **kwargs: the rest of the event's arguments.
        """
        if logs is None or self._steps == 0 or not ({"loss", "train_loss"} & set(logs)):
            return  # (an evaluation's metrics: the steps' figures go with the next training log)
        figures = self.figures()
        logs.update(figures)
        history = getattr(state, "log_history", None)
        if history and history[-1].get("step") == state.global_step:
            history[-1].update(figures)  # Trainer appended a copy of logs before calling us

    def figures(self) -> dict[str, float]:
        """The figures over the steps since the previous call (see the class), then reset.

        Returns:
            The figures (empty when no step ended since the previous call).
        """
        steps, window = self._steps, self._window
        if steps == 0:
            return {}
        self._window, self._steps = {}, 0
        step_s = window.get("step_s", 0.0)
        loading = window.get("data_loading_s", 0.0)
        out = {"data_loading_pct": 100.0 * loading / step_s if step_s > 0 else 0.0}
        out.update({name: window.get(name, 0.0) / steps for name in MEAN_FIGURES})
        if self.ranks:
            out.update(over_ranks(loading / steps))
        return out

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Take the monitor back from the train dataloader.

        Args:
            args: the Trainer's ``TrainingArguments``.
            state: its ``TrainerState`` (``global_step``, ``log_history``).
            control: its ``TrainerControl``.
            **kwargs: the rest of the event's arguments.
        """
        if self._loader is not None and self._loader.monitor is self.monitor:
            self._loader.monitor = None
        self._loader = None
