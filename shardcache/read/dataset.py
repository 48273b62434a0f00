"""ShardDataset: the front of the read pipeline -> token-budget batches, with resumable state.

The pipeline runs one way: a selection (what an epoch reads) -> a planner (its global batches:
one plan, or canonical streams) -> the fetch stage (shards downloaded ahead) -> a sample reader
(tokens, masks, transforms) -> a collator (pad or pack, chosen once). ``ShardDataset`` builds
the stages and keeps the cursor: which global batches this rank and DataLoader worker read,
the state that resumes them, and the stats.

A batch (``Batch``) is a dict of model inputs plus ``batch["meta"]``, as docs/guide/batches.md
lists them; ``labels`` are -100 on padding, outside chat caches' trainable turns and on every
packed segment's first token. State is a global cursor (epoch, global batches consumed),
checked against the cache digest and plan options: it resumes at any world size and workers.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from shardcache.config import check_choice, check_int
from shardcache.errors import ConfigError
from shardcache.read.batch import IDS_DTYPES, Batch, mark_filler, mark_padding, to_batch
from shardcache.read.collate import kernels
from shardcache.read.collate.attention import check_attention
from shardcache.read.collate.collator import Collator, collator, compiled_table, kernels_read
from shardcache.read.exclusion import Exclusion, ExclusionFilter, is_excluded
from shardcache.read.fetch.fetcher import Fetcher
from shardcache.read.fetch.shard_readahead import ReadAheadOptions, readahead_options
from shardcache.read.plan.epoch_plan import EpochPlan, EpochSplit, PlanOptions, split_epoch
from shardcache.read.plan.planner import Planner, batch_options, check_eval, locate, log_tail
from shardcache.read.plan.streams import StreamPlan
from shardcache.read.position import Ranks, SharedPosition, check_worker_resume
from shardcache.read.run_record import RunLog, RunRecord, dataset_spec
from shardcache.read.samples.chain import Transform, TransformChain
from shardcache.read.samples.readers import check_transforms, sample_reader
from shardcache.read.selection.mixture import Source
from shardcache.read.selection.mixture_table import MixtureTable
from shardcache.read.selection.schedule import Schedule, ScheduleTable, as_schedule
from shardcache.read.selection.selection import open_selection
from shardcache.read.selection.splits import Split
from shardcache.read.state import check_cursor, check_data, check_plan, state_epoch, take_state
from shardcache.read.trainers import refuse_accelerate_wrapper

logger = logging.getLogger("shardcache")


class ShardDataset(IterableDataset):
    """Token-budget batches from a cache (or a mixture), sharded over ranks and workers.

    Iterate it through ``DataLoader(ds, batch_size=None)``: each item is already a batch. A
    context manager: ``close`` releases the cache and its open shards. accelerate's wrappers,
    which would split it over ranks again, are refused (docs/guide/batches.md, Trainers).

    Args:
        path: a cache folder or URL, or a list of [`Source`][shardcache.Source] (a mixture of
            caches sharing a tokenizer).
        max_tokens: the token budget of a batch (padding included).
        shuffle: shuffle the epoch (default True).
        seed: the plan's seed (>= 0).
        options: all batch options as one [`PlanOptions`][shardcache.PlanOptions] (then
            without ``max_tokens``, ``shuffle`` or keywords).
        rank: this process's rank; with ``world_size``, else torch.distributed when
            initialised (also later: followed), else ``RANK`` / ``WORLD_SIZE``.
        world_size: the number of ranks.
        expect: a ``CacheKey``, lock file path or mapping of tokenizer options the cache must
            have been built under (for a mixture: each source without its own).
        attention: ``"mask"`` (a 4-D block-causal mask), ``"varlen"`` (flash-attention keys)
            or ``"none"``: required with ``mode="pack"``, refused otherwise.
        ids_dtype: ``"int32"`` or ``"int64"``: ``input_ids``, ``position_ids``, ``attention_mask``.
        tokens_per_epoch: a mixture's epoch size (default: the largest every share fits in;
            ignored with ``eval=True``).
        remix: let ``load_state_dict`` take the state of another mixture (with a warning).
        readahead: how far a remote cache downloads ahead: an int of shards (0: on demand only),
            a [`ReadAheadOptions`][shardcache.ReadAheadOptions] or None (the defaults).
        split: read only one side of ``splits``: ``"train"``, ``"validation"`` or ``"test"``
            (documents, every piece of a split document together; docs/guide/evaluation.md).
            A mixture splits every source as that cache alone, and its weights apply to the
            sources' sides.
        splits: the held-out fractions ([`Split`][shardcache.Split]); required with ``split``
            (a mixture: for every source without its own ``Source(splits=...)``).
        eval: an evaluation pass: no shuffle, every planned sequence exactly once over all
            ranks, no drop or repeat; a rank with no batch left yields a filler batch (labels
            all -100, ``meta["filler"]`` True) so every rank yields the same count. A mixture
            reads every document of every source (of its side) once: no weights or repetitions
            (unequal weights, ``tokens_per_epoch`` or a ``schedule`` warn that they are not
            applied).
        transform: a [`Transform`][shardcache.Transform], ``transform(ids, mask, rng) -> (ids,
            mask)``, or a sequence of them applied in order, to every sequence (or packed
            piece) after it is read and before the batch is collated; ``rng`` is seeded by
            (seed, epoch, sample id, repetition, piece start; and the step, after the first),
            so a resumed stream is the same. It may lengthen a sequence by up to its
            ``max_growth`` attribute (default 0; a sequence of them: the sum), which the plan
            reserves (``PlanOptions.growth``); a transform whose ``keeps_mask`` attribute is
            False is refused on a chat cache, and one with a ``check_tokens`` method is asked
            to refuse ids the cache's tokenizer lacks (FIM and SpanMask check their sentinels)
            when the dataset is built (docs/guide/transforms.md).
        schedule: a mixture's weights over the run ([`Schedule`][shardcache.Schedule], or a
            list of its points): epoch ``w`` is the schedule's window ``w`` (``ds.epochs`` of
            them), each source reads its documents without reuse before all were used, and
            ``max_repetitions`` bound a source over the whole run (docs/guide/mixtures.md).
            A point may set its phase's ``max_tokens``, ``seq_len``, ``mode`` and ``packing``:
            that phase's windows are planned and collated with them (docs/guide/schedules.md;
            ``attention`` is then required if any phase packs, and applies to those).
        **plan_options: the other ``PlanOptions`` fields (``mode``, ``seq_len``, ``packing``,
            ``pad_to_multiple_of``, ``window_size``, ``tail``).

    Raises:
        ConfigError: an option is missing, unknown or out of range (``split`` without
            ``splits``, a mixture source without a split, ``eval`` with ``shuffle=True``, a
            ``growth`` with ``packing="concat"`` and no transform, or a transform that cannot
            keep a chat cache's loss masks); a side of ``splits`` that holds no document; a
            ``max_tokens`` (pad) or ``seq_len`` (``packing="best_fit"``) below the longest
            sequence the epoch reads.
        CacheNotFoundError: no committed cache at ``path``.
        CacheKeyMismatch: the cache was built under another key than ``expect``.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | list[Source],
        max_tokens: int | None = None,
        shuffle: bool | None = None,
        seed: int = 0,
        *,
        options: PlanOptions | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        expect: Any = None,
        attention: str | None = None,
        ids_dtype: str = "int32",
        tokens_per_epoch: int | None = None,
        remix: bool = False,
        readahead: ReadAheadOptions | int | None = None,
        split: str | None = None,
        splits: Split | None = None,
        eval: bool = False,
        transform: Transform | Sequence[Transform] | None = None,
        schedule: Schedule | list[Any] | None = None,
        **plan_options: Any,
    ) -> None:
        super().__init__()
        self.eval = check_eval(eval, shuffle, options)
        if self.eval and shuffle is None and options is None:
            shuffle = False
        chain = None if transform is None else TransformChain(transform)
        self.transform = transform
        self._fetch = Fetcher(readahead_options(readahead))
        #: Attach each batch's stage times to ``meta["stage_s"]`` (``StallMonitor`` sets it).
        self.time_stages = False
        self._plan_s = 0.0  # time planning the pass, charged to its first batch
        growth = None if chain is None else chain.max_growth
        phased = None if self.eval else as_schedule(schedule)
        options = batch_options(options, max_tokens, shuffle, plan_options, growth, phased)
        #: how ranks even out: an evaluation pass wraps, its extra batches become fillers
        self._tail = "wrap" if self.eval else options.tail
        # (attention is for the packed batches: of the dataset, or of a schedule's phase)
        self.attention: str | None = check_attention(
            attention, _attention_mode(options, as_schedule(schedule), self.eval)
        )
        check_choice("ids_dtype", ids_dtype, IDS_DTYPES)
        self.ids_dtype = np.dtype(ids_dtype)
        check_int("seed", seed, 0)
        self.seed = seed
        self.epoch = 0
        self._ranks = Ranks(rank, world_size)
        # streams=None: the world size now; a loaded state's streams win (load_state_dict)
        self._auto_streams = options.streams is None
        if options.streams is None:
            options = dataclasses.replace(options, streams=self._ranks.world_size)
        self.remix = remix
        selection = open_selection(
            path, options, expect=expect, split=split, splits=splits, eval=self.eval,
            tokens_per_epoch=tokens_per_epoch, schedule=as_schedule(schedule),
        )  # fmt: skip
        self.path = selection.path
        self.split_name, self.splits = split, splits
        check_transforms(chain, selection)
        selection.finish(options)
        self._selection = selection
        self.cache_digest = selection.cache_digest
        mixed = selection.state().get("mixture")
        digests = [s["digest"] for s in mixed["sources"]] if mixed else [self.cache_digest]
        self._run = RunLog(dataset_spec(
            path, digests, split=split, splits=splits, eval=self.eval,
            tokens_per_epoch=tokens_per_epoch, schedule=as_schedule(schedule),
            ids_dtype=ids_dtype, attention=self.attention, transform=transform,
        ))  # fmt: skip
        self.pad_id = selection.pad_id
        self.cache_bytes = selection.cache_bytes
        self._planner = Planner(selection, options, seed)
        self._samples = sample_reader(selection, self.ids_dtype, chain, seed, options.growth)
        #: Read batches with the compiled kernels (kernels.py) when numba is installed; False
        #: takes the numpy path (the reference: same batches, slower).
        self.kernels = True
        self._collator: Collator | None = None  # chosen once per setting
        self._start = 0  # global cursor where the current pass started (set/load/restart)
        self._consumed = 0  # live global cursor (this process's iteration)
        self._worker: dict[str, int] | None = None  # worker-level position while iterating
        self._worker_resume: dict[str, Any] | None = None
        self._loaded = False  # the cursor came from load_state_dict: honour it as it is
        # the position persistent DataLoader workers start their next pass from, written by
        # set_epoch / load_state_dict in the main process; _generation is the one this copy's
        # position came from
        self._published = SharedPosition()
        self._generation = 0
        self._excluded = ExclusionFilter(self._run, selection, self.path)

    def __getstate__(self) -> dict[str, Any]:
        # (spawned workers start with the main process's rank); the stages drop what does not
        # travel to a worker process (memory maps, threads, downloads): it opens its own
        self.world_size  # noqa: B018
        return {**self.__dict__, "_collator": None}

    def close(self) -> None:
        """Release the cache, open shards, plan and downloads (reopened when needed); idempotent."""
        self._fetch.close()
        self._selection.close()
        self._planner.reset()
        self._collator = None

    def __enter__(self) -> ShardDataset:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def options(self) -> PlanOptions:
        """The batch options ([`PlanOptions`][shardcache.PlanOptions]), ``streams`` resolved.

        A schedule's phase may set others for its epochs (``schedule.options``).
        """
        return self._planner.options

    @property
    def mixture(self) -> MixtureTable | None:
        """A mixture's per-source numbers ([`MixtureTable`][shardcache.MixtureTable]), or None.

        With a schedule its documents and tokens hold, its weights are not used (``schedule``).
        """
        return self._selection.mixture

    @property
    def schedule(self) -> ScheduleTable | None:
        """A scheduled mixture's phases ([`ScheduleTable`][shardcache.ScheduleTable]), or None.

        When a point sets batch options, ``options[p]`` are phase ``p``'s (``phase_of(epoch)``).
        """
        layout = self._selection.schedule
        return None if layout is None else layout.table(self.options)

    @property
    def epochs(self) -> int | None:
        """A scheduled mixture's epochs (its windows: the run), or None (epochs never end)."""
        layout = self._selection.schedule
        return None if layout is None else layout.windows

    @property
    def rank(self) -> int:
        """This process's rank: as passed, else of the process group (also one started later)."""
        self.world_size  # noqa: B018  (follows a process group started later)
        return self._ranks.rank

    @property
    def world_size(self) -> int:
        """The number of ranks: as passed, else of the process group (also one started later).

        Lightning's launcher starts the group in ``fit()``, after the script built the dataset,
        and sets WORLD_SIZE but no RANK: followed in the main process (workers get its values).
        """
        if self._ranks.follow(self.path, get_worker_info() is not None):
            planner = self._planner
            if self._auto_streams and not planner.started:
                # streams=None is the world size the run starts reading with: nothing was
                # planned or loaded yet, so the process group's is that size
                planner.reset(dataclasses.replace(planner.options, streams=self._ranks.world_size))
        return self._ranks.world_size

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch (reshuffles); persistent DataLoader workers follow it.

        A new epoch starts at cursor 0; the current one keeps its cursor (as a resumed job needs).

        Args:
            epoch: the epoch (>= 0).

        Raises:
            ConfigError: ``epoch`` is negative.
        """
        refuse_accelerate_wrapper(f"ShardDataset({self.path!r})", self.rank, self.world_size)
        epoch = int(epoch)
        if epoch < 0:
            raise ConfigError(f"set_epoch: got {epoch}, expected an epoch >= 0")
        self._selection.check_epoch(epoch)
        if epoch != self.epoch:
            self.epoch = epoch
            self._start = self._consumed = 0
            self._loaded = False
        self._generation = self._published.publish(
            self.epoch, self._consumed, self._loaded, get_worker_info() is not None
        )

    def plan(self, epoch: int | None = None) -> EpochPlan | StreamPlan:
        """The global batch plan of an epoch for all ranks.

        With canonical streams (``PlanOptions.streams`` > 0) a ``StreamPlan`` that plans a block
        of a stream when a batch of it is first asked for; with ``streams=0`` the whole
        ``EpochPlan``, computed once per machine and epoch.

        Args:
            epoch: the epoch (None: the current one).

        Returns:
            The plan.
        """
        epoch = self.epoch if epoch is None else int(epoch)
        return self._planner.plan(epoch, self.world_size, get_worker_info() is None)

    def locate_batch(
        self, epoch: int, index: int, rounds: int | None = None
    ) -> tuple[EpochPlan, int]:
        """The plan part holding global batch ``index`` of ``epoch``, and the batch's place in it.

        ``collate_batch(part, place)`` reads the batch. With canonical streams and ``rounds``
        (the epoch is whole rounds: every stream has ``rounds`` batches, global batch ``j`` is
        batch ``j // C`` of stream ``j % C``; ``RunRecord.epoch_rounds``) only that stream is
        planned, not the epoch: what a rewind of one step of a huge epoch needs.

        Args:
            epoch: the epoch.
            index: the global batch.
            rounds: the epoch's stream length when its streams are whole rounds (None: plan
                the epoch).

        Returns:
            ``(part, place)``: a stream's block (or the global plan) and the batch in it.
        """
        if rounds is None or self._planner.is_global():
            return locate(self.plan(epoch), index)
        return self._planner.seek(epoch, index, rounds)

    def prepare(self, epoch: int | None = None) -> None:
        """Plan an epoch with the other ranks: each counts its own streams' batches, then all share.

        A collective under ``torch.distributed``: call it on every rank at the same point (for
        example after ``set_epoch``). Without it each machine counts every stream's batches
        itself (bounded memory, time in proportion to the epoch).

        Args:
            epoch: the epoch (None: the current one).
        """
        epoch = self.epoch if epoch is None else int(epoch)
        planner = self._planner
        if planner.is_global() or planner.has_counts(epoch):
            return
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized()):
            self.plan(epoch)
            return
        group = (self.rank, self.world_size, dist.get_world_size())
        planner.share_counts(epoch, *group, dist.all_gather_object)

    def split(self, epoch: int | None = None, start: int = 0) -> EpochSplit:
        """How the global batches of an epoch go to ranks.

        Args:
            epoch: the epoch (None: the current one).
            start: the global cursor the batches are dealt from.

        Returns:
            The split.
        """
        epoch = self.epoch if epoch is None else int(epoch)
        total = self._run.planned(epoch, self.plan(epoch))
        return split_epoch(total, self.world_size, start, self._tail)

    def batches_per_rank(self, epoch: int | None = None) -> int:
        """How many batches every rank yields in a whole epoch (for LR schedulers).

        Args:
            epoch: the epoch (None: the current one).

        Returns:
            The count, the same on every rank.
        """
        return self.split(epoch).batches_per_rank

    def __len__(self) -> int:
        """Batches this rank yields in the current (or next) pass over the current epoch."""
        refuse_accelerate_wrapper(f"ShardDataset({self.path!r})", self.rank, self.world_size)
        n = self.split(start=_pass_start(self, self._start)).batches_per_rank
        if n == 0 and self._start == 0:
            _warn_empty(self, len(self.plan()))
        return n

    def tail_report(self, epoch: int | None = None) -> dict[str, Any]:
        """What an epoch drops (``tail="drop"``) or repeats (``"wrap"``) to even out ranks.

        Over canonical streams as over the global plan this is at most ``world_size - 1``
        batches: the streams' own batch counts are not evened out, their longer streams' last
        batches are dealt to all ranks.

        Args:
            epoch: the epoch (None: the current one, from the pass's start: after
                ``load_state_dict``, the loaded position).

        Returns:
            A JSON-able dict: tail mode, world size, global batches, the global cursor the
            count starts at (``start``), per-rank batches, and the batches, segments and
            tokens dropped and repeated.
        """
        if epoch is None or int(epoch) == self.epoch:
            split = self.split(start=_pass_start(self, self._start))
        else:
            split = self.split(int(epoch))
        epoch = self.epoch if epoch is None else int(epoch)
        return self._planner.tail_report(epoch, split, self._tail)

    def state_dict(self, *, steps: int | None = None) -> dict[str, Any]:
        """The resumable position, JSON-able.

        Args:
            steps: None for this object's live position (inside a DataLoader worker: the
                worker's own); ``k`` for the position after this rank took ``k`` batches since
                ``set_epoch`` / ``load_state_dict`` (behind a plain DataLoader).

        Returns:
            ``version``, ``cache_digest``, ``seed``, ``plan``, ``epoch``, ``consumed`` and
            ``world_size`` (plus ``mixture``, and ``worker`` inside a worker).

        Raises:
            ConfigError: ``steps`` is not an integer in ``[0, batches of this pass]``.
        """
        if steps is None:
            consumed = self._consumed
        else:
            start = _pass_start(self, self._start)
            available = self.split(start=start).batches_per_rank
            if isinstance(steps, bool) or not isinstance(steps, int) or not 0 <= steps <= available:
                raise ConfigError(
                    f"steps: got {steps!r}, expected an integer in [0, {available}] (the "
                    f"batches this rank yields from global batch {start} of epoch {self.epoch})"
                )
            consumed = start + self.world_size * steps
        worker = self._worker if steps is None else None
        state = take_state(
            self._selection, self.seed, self.options, self.epoch, consumed, self.world_size, worker
        )
        state["run"] = self.run_record().to_json()
        return state

    @property
    def grad_accum(self) -> int:
        """Micro-batches per rank and optimizer step (gradient accumulation), for the run record.

        Default: a loaded state's run's, else 1. Set it before ``load_state_dict`` when a resume
        changes it. ``write_run_record(..., grad_accum=)`` sets it too.
        """
        return self._run.accumulation()

    @grad_accum.setter
    def grad_accum(self, value: int) -> None:
        check_int("grad_accum", value, 1)
        self._run.grad_accum = value

    def run_record(self) -> RunRecord:
        """The run record: what recomputes this reader's stream, and where each step reads.

        Also inside every state (``state["run"]``); ``write_run_record`` writes it beside the
        checkpoints, and ``shardcache rewind`` reads it (docs/guide/loss-spikes.md).

        Returns:
            The record: how the reader was opened (sources with their key digests, split,
            transforms), the batch options and seed, the segments of the run (world size,
            gradient accumulation, the cursor each starts at), skipped steps and the batch
            counts of the epochs planned.
        """
        options = self.options.to_json()
        return self._run.record(
            self.cache_digest, self.seed, options, self.world_size, lambda e: len(self.plan(e))
        )

    def load_state_dict(
        self,
        state: dict[str, Any],
        *,
        skip_steps: Sequence[tuple[int, int]] | None = None,
        exclude: Sequence[Any] | None = None,
    ) -> None:
        """Continue from a state, at any world size and ``num_workers``.

        Args:
            state: what ``state_dict`` returned, or a whole ``StatefulDataLoader`` state (its
                worker states together give the global cursor).
            skip_steps: optimizer step ranges ``(first, end)`` (steps ``first .. end - 1``, in
                the numbering and shape of the run that took ``state``) to continue as if
                read: when the state's step ``s`` is in one, the stream goes on with step
                ``end``'s batches, as the uninterrupted run read them, every rank even; the
                trainer counts on from ``s``. Ranges before ``s`` are ignored. Recorded in the
                run record and ``stats()["skipped_steps"]``. A state without a run record
                counts steps from its own position.
            exclude: documents (``"FILE:RECORD"`` or ``(file, record)``; a file of them:
                ``shardcache.read.exclusion.read_documents``) to leave out from the loaded
                position on (after ``skip_steps``): every batch from there has their segments
                taken out, the batches before it and the plan unchanged (docs/guide/loss-spikes.md).
                Recorded in the state, the run record and ``stats()["exclusions"]``. A state
                whose run already leaves documents out must be given them again here (with
                any new ones).

        Raises:
            StateError: the state is of another cache, plan or mixture (see ``remix``), or damaged;
                its run leaves out documents ``exclude`` does not name.
            ConfigError: a skip range is malformed, starts after the state's step, or the state
                was taken inside a step; a document is malformed or in no source, or is to be
                excluded from a DataLoader worker's own state (other workers may have read past it).
        """
        state, remixed = check_data(state, self._selection, self.remix)
        options = check_plan(state, self.seed, self.options, self._auto_streams)
        if options != self.options:
            self._planner.reset(options)
        self._auto_streams = False  # the state's streams hold from here
        epoch = state_epoch(state)
        self._run.counts, self._run.rounds = {}, {}
        total = self._run.planned(epoch, self.plan(epoch))
        consumed, self._worker_resume = check_cursor(
            state, total, self.world_size, remixed, self.path
        )
        moved = self._run.resume(
            state, (epoch, consumed), lambda e: len(self.plan(e)), self._tail, skip_steps, remixed
        )
        if moved is not None:  # a skip: the cursor of the step after the skipped ones
            (epoch, consumed), self._worker_resume = moved, None
        where = f"ShardDataset({self.path!r}).load_state_dict"
        new = self._excluded.loaded(exclude, self._worker_resume, where)
        # (resolved before the position moves: an unknown document leaves the reader as it was)
        exclusion = Exclusion(epoch, consumed, self._excluded.resolve(new)) if new else None
        self.epoch = epoch
        self._start = self._consumed = consumed
        if exclusion is not None:
            self._excluded.add(exclusion)
        self._loaded = True
        self._generation = self._published.publish(
            self.epoch, self._consumed, self._loaded, get_worker_info() is not None
        )

    def exclude(self, documents: Sequence[Any], at: tuple[int, int] | None = None) -> Exclusion:
        """Leave documents out from a position on: the batches before it stay as they were.

        ``load_state_dict(state, exclude=...)`` is the usual way (the position: the loaded one).
        The position is this process's: with DataLoader workers it does not follow their
        reads, so exclude when loading a state (or before the first pass).

        Args:
            documents: ``"FILE:RECORD"`` or ``(file, record)`` each (the input file as
                ``shardcache show --source`` names it, a 0-based record index).
            at: the global position ``(epoch, consumed)`` it starts at (None: this reader's).

        Returns:
            The exclusion, as the run record holds it.

        Raises:
            ConfigError: ``at`` is before this reader's position (it would change batches
                already read), a document is malformed, or no source holds it.
        """
        return self._excluded.starting((self.epoch, self._consumed), at, documents)

    def __iter__(self) -> Iterator[Batch]:
        refuse_accelerate_wrapper(f"ShardDataset({self.path!r})", self.rank, self.world_size)
        self._selection.open()
        info = get_worker_info()
        worker_id, num_workers = (0, 1) if info is None else (info.id, info.num_workers)
        resume, self._worker_resume = self._worker_resume, None
        if info is not None and resume is None:  # a persistent worker: adopt a new position
            adopted = self._published.adopt(self._generation)
            if adopted is not None:
                self._generation, epoch, self._start, self._loaded = adopted
                self._consumed = self._start
                if epoch != self.epoch:
                    self._planner.reset()
                self.epoch = epoch
        planned = time.perf_counter()
        plan = self.plan()
        self._plan_s = time.perf_counter() - planned
        if resume is not None:
            check_worker_resume(resume, worker_id, num_workers, self.world_size)
            start, skip = int(resume["start"]), int(resume["yielded"])
        else:
            start, skip = _pass_start(self, self._consumed), 0
        split = split_epoch(len(plan), self.world_size, start, self._tail)
        self._run.planned(self.epoch, plan)
        mine = split.for_rank(self.rank)
        if start == 0 and worker_id == 0 and split.batches_per_rank == 0:
            _warn_empty(self, len(plan))
        positions = np.arange(worker_id, len(mine), num_workers)
        if info is None:
            self._start = start
        if self.rank == 0 and worker_id == 0 and start == 0:
            log_tail(split, self.epoch)
        done = int(positions[skip - 1]) + 1 if skip else 0
        self._consumed = start + self.world_size * done
        self._worker = None
        if info is not None:
            self._worker = {
                "id": worker_id,
                "num_workers": num_workers,
                "world_size": self.world_size,
                "start": start,
                "yielded": skip,
            }
        return self._generate(plan, mine, positions[skip:], start)

    def _generate(
        self, plan: EpochPlan | StreamPlan, mine: np.ndarray, positions: np.ndarray, start: int
    ) -> Iterator[Batch]:
        where = f"ShardDataset({self.path!r})"
        selection, samples, fetch = self._selection, self._samples, self._fetch
        scheduled = selection.schedule is not None
        rank, world = self.rank, self.world_size  # (a pass keeps its process group)
        readahead = fetch.begin(selection, plan, samples.samples, mine[positions], where)
        try:
            for n, position in enumerate(positions.tolist()):
                began = time.perf_counter()
                if readahead is not None:
                    readahead.ready(n)
                fetched = time.perf_counter()
                samples.gather_s = 0.0
                virtual = start + rank + world * position  # (past the end: wrapped)
                wrap = virtual // len(plan) if samples.chain is not None else 0
                index = int(mine[position])
                batch = self.collate_batch(plan, index, wrap, position=virtual)
                if scheduled:
                    ids, _, pieces = plan.segments(index)
                    out = self._excluded.units(self.epoch, virtual)
                    if out is not None:  # (what was left out was not delivered)
                        kept = ~is_excluded(ids, out)
                        ids, pieces = ids[kept], None if pieces is None else pieces[kept]
                    selection.observe(ids, pieces, self.epoch)
                if self.time_stages:
                    built = time.perf_counter() - fetched
                    batch["meta"]["stage_s"] = {
                        "plan_s": self._plan_s,
                        "fetch_s": fetched - began,
                        "gather_s": samples.gather_s,
                        "collate_s": built - samples.gather_s,
                    }
                    self._plan_s = 0.0
                if self.eval:  # past the plan's end: a wrapped batch that must not count
                    mark_filler(batch, virtual >= len(plan) or bool(batch["meta"].get("filler")))
                # a batch counts as consumed once it is handed out (the torchdata convention)
                self._consumed = start + world * (position + 1)
                if self._worker is not None:
                    self._worker["yielded"] += 1
                handed = time.perf_counter()
                yield batch
                fetch.stats.consumed(time.perf_counter() - handed)
        finally:
            fetch.end(readahead)
        # the pass is over: its shards close here, not at the next pass or close(); the next
        # pass reopens what it reads (a remote cache's local copies stay on disk)
        selection.close_shards()
        # the pass is done: the next one (in-process, or of a persistent worker) replays from 0
        self._loaded = False
        if self._worker is None:
            self._start = 0
        else:
            self._consumed = start + self.world_size * len(mine)

    def stats(self) -> dict[str, Any]:
        """What reading from object storage cost this process, all passes (zeros for a local cache).

        Returns:
            ``batches``, ``first_wait_s`` (first batches), ``wait_s`` / ``longest_wait_s`` (others),
            ``elapsed_s``, ``wait_share``, ``consumer_s`` (the consumer's own time between
            batches), ``bytes_ahead`` / ``shards_ahead``, ``bytes_on_demand`` /
            ``shards_on_demand``, ``retried``, ``warned`` (each DataLoader worker its own);
            ``share_bytes`` (the cache's bytes over the world size) and ``fetched_over_share``
            (bytes fetched per epoch read, over that share: about 1 when reading locally);
            with a schedule, ``schedule``: the epochs (windows) read, ``delivered_tokens`` and
            ``delivered_shares`` per source, and ``scheduled_shares`` (the schedule's shares of
            each window, weighted by the tokens read in it); after a resume with
            ``skip_steps``, ``skipped_steps``: each range with the cursors it moved between;
            with excluded documents, ``exclusions``: each one's position (``epoch``,
            ``consumed``) and ``documents`` (``FILE:RECORD``), and ``excluded_segments``: the
            segments this process took out of its batches.
        """
        stats = self._fetch.as_dict(self.cache_bytes, self.world_size)
        if self._run.skipped:
            stats["skipped_steps"] = self._run.stats()
        stats.update(self._excluded.stats())
        schedule = self._selection.schedule_stats()
        if schedule is not None:
            stats["schedule"] = schedule
        return stats

    def collate_batch(
        self,
        plan: EpochPlan | StreamPlan,
        index: int,
        wrap: int = 0,
        position: int | None = None,
    ) -> Batch:
        """Read global batch ``index`` of ``plan`` and build its tensors.

        Args:
            plan: an epoch plan of this dataset.
            index: the global batch.
            wrap: how many times ``tail="wrap"`` went round the epoch's global batches before
                this read of the batch (0: its first read). A transform seeds a read again
                anew; without a transform it changes nothing.
            position: the batch's virtual index in the current epoch's deal (past the plan's
                end: read again under ``tail="wrap"``), which decides the exclusions in force
                (None: ``index``). Their documents' segments are taken out; a batch left with
                none is read as padding (``meta["filler"]`` True, no trainable token).

        Returns:
            The batch.

        Raises:
            CorruptShardError: a shard is damaged or disagrees with the length index.
        """
        options = self._planner.options_for(self.epoch)  # (a schedule phase's)
        made = self._collator
        if made is None or made.uses_kernels != self.kernels or made.options != options:
            attention = self.attention if options.mode == "pack" else None
            self._collator = collator(self._samples, options, attention, self.kernels)
        units = self._excluded.units(self.epoch, index if position is None else position)
        part, index = locate(plan, index)
        # (a batch left with nothing keeps its shape, read as padding)
        part, index, emptied = self._excluded.cut(part, index, units)
        arrays, meta = self._collator(part, index, wrap, self.epoch)
        self._selection.annotate(meta)
        batch = to_batch(arrays, meta)
        if emptied:
            mark_padding(batch, self.pad_id)
        return batch

    @property
    def reads_compiled(self) -> bool:
        """Whether the compiled kernels build batches here (numba, a local uncompressed cache).

        Never for preference pairs, with a transform or with per-token columns (loss
        weights): the numpy path collates them.
        """
        selection = self._selection
        if not kernels_read(self._samples) or not selection.is_open():
            return False
        return compiled_table(selection, self.kernels) is not None


def _attention_mode(options: PlanOptions, schedule: Schedule | None, eval: bool) -> str:
    """``"pack"`` if any epoch packs (the dataset's options, or a schedule phase's), else pad."""
    if schedule is None or eval or not schedule.sets_options:
        return options.mode
    every = schedule.every_phase_options(options)
    return "pack" if any(o.mode == "pack" for o in every) else "pad"


def _pass_start(ds: ShardDataset, cursor: int) -> int:
    """Where a pass begins: ``cursor``, or 0 if the epoch is spent there (unless loaded)."""
    if cursor and not ds._loaded and ds.split(start=cursor).batches_per_rank == 0:
        return 0
    return cursor


def _warn_empty(ds: ShardDataset, total: int) -> None:
    """Warn (once per dataset) when more ranks than batches leave every rank with none."""
    if total < ds.world_size and not getattr(ds, "_warned_empty", False):
        ds._warned_empty = True  # type: ignore[attr-defined]
        warnings.warn(
            f"ShardDataset({ds.path!r}): world_size={ds.world_size} but epoch "
            f"{ds.epoch} has {total} global batches, so every rank gets 0 batches; use "
            "a smaller max_tokens, fewer ranks, or tail='wrap'",
            stacklevel=3,
        )


kernels.warm_up()
