"""The plan stage of the read pipeline: an epoch's global batches, as one plan or as streams.

A ``Planner`` asks its selection for the epoch's units and batch options (a schedule's phase
may set its own: ``options_for``; counts and stored plans are keyed on them) and gives an
``EpochPlan`` (the global plan, computed once per machine) or a ``StreamPlan`` (canonical
streams: a rank plans the blocks it reads). Both satisfy ``Plan``. The planner owns the
per-epoch batch counts of the streams (counted here, read from another process of the machine,
counted ahead in a background thread, or shared by ``prepare`` among ranks) and hands them to
nothing upstream.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import threading
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from shardcache.config import check_known
from shardcache.errors import ConfigError
from shardcache.read.plan.epoch_plan import EpochPlan, EpochSplit, PlanOptions, split_epoch
from shardcache.read.plan.plan_store import plan_digest, read_counts, shared_plan, write_counts
from shardcache.read.plan.streams import (
    StreamLayout,
    StreamPlan,
    count_batches,
    own_streams,
    seek_batch,
)
from shardcache.read.selection.selection import Selection

logger = logging.getLogger("shardcache")


class Plan(Protocol):
    """An epoch's global batches: what the sample readers and collators read.

    Implemented by ``EpochPlan`` (the global plan) and ``StreamPlan`` (canonical streams).
    """

    def __len__(self) -> int:
        """The number of global batches."""

    def batch(self, index: int) -> np.ndarray:
        """The planned units of global batch ``index``."""

    def segments(self, index: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """Global batch ``index``'s units, their starts and (concat pieces) lengths."""

    def token_count(self, lengths: np.ndarray, index: int) -> int:
        """The tokens of global batch ``index``."""


class Planner:
    """An epoch's plan over a selection, with the streams' batch counts it needs.

    Args:
        selection: what an epoch reads.
        options: the batch options (``streams`` resolved).
        seed: the plan's seed.
    """

    def __init__(self, selection: Selection, options: PlanOptions, seed: int) -> None:
        self.selection = selection
        self.options = options
        self.seed = seed
        self._plan: tuple[int, EpochPlan | StreamPlan] | None = None
        #: stream batch counts by epoch (small; travel to workers with the dataset)
        self._counts: dict[int, dict[int, np.ndarray]] = {}
        self._counting: threading.Thread | None = None  # the next epoch's, in the background

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_plan"] = state["_counting"] = None
        return state

    def reset(self, options: PlanOptions | None = None) -> None:
        """Forget the plan (and, with new ``options``, the counts): they are planned anew."""
        self._plan = None
        if options is not None:
            self.options, self._counts = options, {}

    @property
    def started(self) -> bool:
        """Whether anything was planned or counted yet."""
        return self._plan is not None or bool(self._counts)

    def options_for(self, epoch: int) -> PlanOptions:
        """The batch options of ``epoch``: the selection's for it (a schedule phase's), else ours.

        Args:
            epoch: the epoch (a schedule's window).

        Returns:
            The options the epoch is planned, counted, stored and collated with.
        """
        return self.selection.epoch_options(self.options, epoch)

    def planning(self, epoch: int) -> PlanOptions:
        """The planners' options of ``epoch``: for pairs in pad mode half the budget.

        In pad mode a pair unit is two rows; in pack mode a pair is one unit of its two
        sequences, each of which a transform may lengthen: twice the growth.
        """
        options = self.options_for(epoch)
        if not self.selection.pairs:
            return options
        if options.mode == "pack":
            growth = 2 * options.growth
            return dataclasses.replace(options, growth=growth) if growth else options
        return dataclasses.replace(options, max_tokens=options.max_tokens // 2)

    def plan(self, epoch: int, world_size: int, ahead: bool) -> EpochPlan | StreamPlan:
        """The plan of ``epoch``; ``ahead``: count the next epoch's streams in the background."""
        if self._plan is None or self._plan[0] != epoch:
            if self.is_global():
                count = self.selection.unit_count()
                plan: EpochPlan | StreamPlan = shared_plan(
                    self.digest(epoch),
                    count,
                    lambda: self.selection.plan_epoch(self.planning(epoch), self.seed, epoch),
                )
            else:
                plan = self._stream_plan(epoch, world_size, ahead)
            self._plan = (epoch, plan)
        return self._plan[1]

    def split(self, epoch: int, world_size: int, start: int, tail: str) -> EpochSplit:
        """How the global batches of ``epoch`` go to ranks from cursor ``start``."""
        return split_epoch(len(self.plan(epoch, world_size, True)), world_size, start, tail)

    def is_global(self) -> bool:
        """Whether an epoch is one global plan: ``streams=0``, or one stream of one block.

        One stream of one block is the global plan by construction (``streams.plan_block``);
        planning it whole keeps its plan an ``EpochPlan`` shared per machine, as before streams.
        """
        streams = self.options.streams
        if streams != 1:
            return streams == 0
        return self.selection.expected_units() <= self.options.shuffle_block

    def digest(self, epoch: int) -> str:
        """The plan's identity for the machine-wide plan store (the epoch's options)."""
        options = json.dumps(self.options_for(epoch).to_json(), sort_keys=True)
        return plan_digest(self.selection.data_identity, options, self.seed, epoch)

    def layout(self, epoch: int) -> StreamLayout:
        """An epoch's shards dealt to the canonical streams."""
        options = self.options_for(epoch)
        assert options.streams  # (plan() takes the global plan for 0)
        index = self.selection.shard_index(self.seed, epoch)
        return StreamLayout(
            index, options.streams, options.shuffle_block, self.seed, epoch, options.shuffle
        )

    def seek(self, epoch: int, index: int, rounds: int) -> tuple[EpochPlan, int]:
        """Global batch ``index`` of an epoch of streams in whole rounds, one stream planned.

        With ``rounds`` batches in every stream, global batch ``j`` is batch ``j // C`` of
        stream ``j % C``: only that stream's blocks are counted and its one block planned.
        """
        layout = self.layout(epoch)
        stream, k = index % layout.streams, index // layout.streams
        return seek_batch(layout, self.planning(epoch), stream, k, rounds)

    def has_counts(self, epoch: int) -> bool:
        """Whether ``epoch``'s stream counts are known here."""
        return epoch in self._counts

    def count_own(self, epoch: int, streams: list[int]) -> dict[int, np.ndarray]:
        """The batch counts of ``streams`` of ``epoch`` (this rank's share of ``prepare``)."""
        return count_batches(self.layout(epoch), self.planning(epoch), streams)

    def share_counts(
        self,
        epoch: int,
        rank: int,
        world_size: int,
        group_size: int,
        all_gather_object: Callable[[list[Any], Any], Any],
    ) -> None:
        """Count this rank's streams of ``epoch`` and gather every rank's (a collective).

        Raises:
            ConfigError: the ranks did not count every stream (other options or world sizes).
        """
        streams = int(self.options.streams or 1)
        own = self.count_own(epoch, own_streams(streams, rank, world_size))
        gathered: list[Any] = [None] * group_size
        all_gather_object(gathered, {s: c.tolist() for s, c in own.items()})
        counts = {
            int(s): np.asarray(c, dtype=np.int64) for part in gathered for s, c in part.items()
        }
        if set(counts) != set(range(streams)):
            raise ConfigError(
                f"ShardDataset.prepare: the ranks counted streams {sorted(counts)[:8]}... of "
                f"{streams}; every rank must construct the dataset with the same options and "
                f"world_size={world_size} (torch.distributed has {group_size})"
            )
        self._counts[epoch] = counts
        write_counts(self.digest(epoch), counts)

    def _stream_counts(self, layout: StreamLayout, epoch: int) -> dict[int, np.ndarray]:
        """Every block's batch count: this process's, this machine's, or computed here."""
        counts = self._counts.get(epoch)
        if counts is not None:
            return counts
        thread = self._counting
        if thread is not None and thread.is_alive():
            thread.join()  # the next epoch's, counted in the background: nearly done
            counts = self._counts.get(epoch)
            if counts is not None:
                return counts
        counts = self._machine_counts(layout, epoch)
        self._counts = {e: c for e, c in self._counts.items() if e > epoch - 2}
        self._counts[epoch] = counts
        return counts

    def _machine_counts(self, layout: StreamLayout, epoch: int) -> dict[int, np.ndarray]:
        """The counts another process of this machine stored, else counted here and stored."""
        digest = self.digest(epoch)
        counts = read_counts(digest)
        if counts is None or set(counts) != set(range(layout.streams)):
            counts = count_batches(layout, self.planning(epoch))
            write_counts(digest, counts)
        return counts

    def _stream_plan(self, epoch: int, world_size: int, ahead: bool) -> StreamPlan:
        layout = self.layout(epoch)
        counts = self._stream_counts(layout, epoch)
        streams = int(self.options.streams or 1)
        touched = streams // math.gcd(streams, world_size)  # streams this rank reads
        keep = 2 * min(touched, 64) + 2
        plan = StreamPlan(layout, self.planning(epoch), counts, keep=keep)
        # (a cache of one block's rows counts in milliseconds: no thread for it)
        if ahead and int(layout.row_cum[-1]) > self.options.shuffle_block:
            self._count_ahead(epoch + 1)
        return plan

    def _count_ahead(self, epoch: int) -> None:
        """Count the next epoch's batches in a background thread, so its start does not wait."""
        if epoch in self._counts or (self._counting is not None and self._counting.is_alive()):
            return

        def run() -> None:
            try:
                self._counts[epoch] = self._machine_counts(self.layout(epoch), epoch)
            except Exception:  # the epoch is counted again when it comes, and raises there
                logger.debug("shardcache: counting epoch %d ahead failed", epoch, exc_info=True)

        self._counting = threading.Thread(target=run, name="shardcache-plan-ahead", daemon=True)
        self._counting.start()

    def tail_report(self, epoch: int, split: EpochSplit, tail: str) -> dict[str, Any]:
        """What a whole epoch drops or repeats to even out ranks (``ShardDataset.tail_report``)."""
        plan = self.plan(epoch, split.world_size, True)
        selection = self.selection
        lengths = selection.unit_lengths()
        per = 1
        if selection.pairs:  # a unit is two sequences of both sides' tokens
            lengths, per = selection.counted_lengths(), 2

        def count(batches: np.ndarray) -> tuple[int, int]:
            segs = per * sum(len(plan.batch(int(b))) for b in batches)
            tokens = sum(plan.token_count(lengths, int(b)) for b in batches)
            return segs, tokens

        dropped, repeated = count(split.dropped), count(split.repeated)
        return {
            "tail": tail,
            "world_size": split.world_size,
            "global_batches": len(plan),
            "start": split.start,
            "batches_per_rank": split.batches_per_rank,
            "dropped_batches": len(split.dropped),
            "dropped_segments": dropped[0],
            "dropped_tokens": dropped[1],
            "repeated_batches": len(split.repeated),
            "repeated_segments": repeated[0],
            "repeated_tokens": repeated[1],
            # canonical streams: batches a shorter stream cut in two to be as long as the longest
            "split_batches": plan.split_total if isinstance(plan, StreamPlan) else 0,
        }


def locate(plan: EpochPlan | StreamPlan, index: int) -> tuple[EpochPlan, int]:
    """Global batch ``index`` of ``plan`` as a batch of an ``EpochPlan`` (a stream's block)."""
    if isinstance(plan, StreamPlan):
        return plan.locate(index)
    return plan, index


def batch_options(
    options: PlanOptions | None,
    max_tokens: int | None,
    shuffle: bool | None,
    plan_options: dict[str, Any],
    growth: int | None,
    schedule: Any = None,
) -> PlanOptions:
    """The batch options: ``options``, or built from the keywords.

    ``growth``: what the transforms may add to a sequence, reserved by the plan (None: no
    transform); ``schedule``: a schedule whose points may set their phases' options, each
    checked as the dataset's are.
    """
    if options is not None:
        if max_tokens is not None or shuffle is not None or plan_options:
            raise ConfigError(
                "ShardDataset: pass the batch options either as options=PlanOptions(...) "
                "or as max_tokens=/shuffle=/keywords, not both"
            )
        if not isinstance(options, PlanOptions):
            raise ConfigError(f"options: got {options!r}, expected a PlanOptions")
    else:
        if max_tokens is None:
            raise ConfigError("max_tokens: required (the token budget of a batch)")
        shuffle = True if shuffle is None else shuffle
        fields = PlanOptions.__dataclass_fields__
        check_known("ShardDataset", plan_options, fields, noun="batch option")
        options = PlanOptions(max_tokens=max_tokens, shuffle=shuffle, **plan_options)
    if (
        growth is not None and growth > options.growth
    ):  # the plan reserves what the transforms may add
        options = dataclasses.replace(options, growth=growth)
    _check_concat_growth(options, growth, "")
    if schedule is not None and schedule.sets_options:
        try:
            phases = schedule.every_phase_options(options)
        except ConfigError:
            return options  # (the selection refuses them, naming the point)
        for i, (point, phase) in enumerate(zip(schedule.points, phases)):
            where = f"schedule point #{i + 1} (at_tokens={point.at_tokens:,}), its phase's "
            _check_concat_growth(phase, growth, where)
    return options


def _check_concat_growth(options: PlanOptions, growth: int | None, where: str) -> None:
    """Refuse a reserved ``growth`` under concat packing without a transform to fill it."""
    concat = options.mode == "pack" and options.packing == "concat"
    if options.growth and concat and growth is None:
        raise ConfigError(
            f"{where}growth: {options.growth} with packing='concat' but no transform; concat "
            "then plans documents longer than they are, for a transform to fill. Pass "
            "the transform, or growth=0"
        )


def check_eval(value: Any, shuffle: bool | None, options: PlanOptions | None) -> bool:
    """Check ``eval=``: a bool, and an evaluation pass is never shuffled."""
    if not isinstance(value, bool):
        raise ConfigError(f"eval: got {value!r}, expected True or False")
    if value and (shuffle or (options is not None and options.shuffle)):
        raise ConfigError(
            "eval: an evaluation pass reads in a fixed order, but shuffle=True was given; "
            "drop shuffle= (eval=True reads unshuffled) or pass shuffle=False"
        )
    return value


def log_tail(split: EpochSplit, epoch: int) -> None:
    """Log what evening the ranks out drops or repeats of an epoch (rank 0, worker 0)."""
    if len(split.dropped) or len(split.repeated):
        logger.info(
            "shardcache: epoch %d: %d global batches over %d ranks -> %d per rank; "
            "tail=%s drops %d and repeats %d batches (see ShardDataset.tail_report())",
            epoch,
            split.num_batches,
            split.world_size,
            split.batches_per_rank,
            split.tail,
            len(split.dropped),
            len(split.repeated),
        )
