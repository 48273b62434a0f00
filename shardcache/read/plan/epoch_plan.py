"""The epoch plan and its split over ranks and workers: pure numpy over the length index.

A plan depends on lengths, buckets, options, seed and epoch only, never on world size or worker
count. Rank ``r`` of ``W`` takes global batches ``c + r, c + r + W, ...`` from cursor ``c``,
dealt round-robin to DataLoader workers in the order the DataLoader collects: a rank's stream
does not depend on ``num_workers``, and "every rank took ``k`` batches" is cursor ``c + kW``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

import numpy as np

from shardcache.config import check_choice, check_int
from shardcache.errors import ConfigError
from shardcache.read.plan.plan_arrays import EpochPlan  # (importers take it from here too)
from shardcache.read.plan.policies import modes, packings, policy_for

#: Sequences per window. Larger windows sort more sequences of similar length together (less
#: padding in pad mode, tighter rows in best_fit) but mix the order less;
#: benchmarks/bench_read.py measures the efficiency a window size gives.
DEFAULT_WINDOW_SIZE = 4096
#: Rows a canonical stream shuffles together (``PlanOptions.shuffle_block``): the unit a rank
#: plans, holds and fetches at a time; benchmarks/bench_scale.py measures what it costs.
DEFAULT_SHUFFLE_BLOCK = 1 << 18
#: The most canonical streams an epoch may have.
MAX_STREAMS = 1 << 20
TAILS = ("drop", "wrap")


#: The most tokens a batch may hold: past it the batch arrays alone take gigabytes, a typo (an
#: extra digit, a ``seq_len`` given as ``max_tokens``) that would otherwise end in an OOM kill.
MAX_BATCH_TOKENS = 1 << 27
#: The fewest bytes a batch array set takes per token (int32 ids and positions, int64 labels).
BATCH_BYTES_PER_TOKEN = 16


@dataclass(frozen=True)
class PlanOptions:
    """How an epoch is cut into batches; validated at construction, round-trips through JSON.

    Args:
        max_tokens: bound on ``rows x padded length`` of every batch.
        shuffle: shuffle the epoch (seeded by seed and epoch).
        pad_to_multiple_of: round a pad batch's length up to a multiple of this.
        window_size: sequences sorted or packed together: larger windows pad less, mix less.
        mode: ``"pad"`` (whole sequences of one bucket, padded to the longest row) or
            ``"pack"`` (rows of exactly ``seq_len`` slots).
        seq_len: the row length; pack mode only, where it is required.
        packing: the pack-mode policy (``shardcache.read.plan.policies.packings()``):
            ``"best_fit"`` (whole sequences, best-fit decreasing per window) or ``"concat"``
            (one stream cut every ``seq_len`` tokens; documents may span rows).
        tail: global batches that do not divide among ranks: ``"drop"`` or ``"wrap"``.
        streams: canonical streams (docs/guide/scale.md): each epoch the shards are dealt to
            this many streams and global batch ``j`` comes from stream ``j % streams``, so a
            rank of ``W`` dividing ``streams`` reads only ``1 / W`` of the cache. ``None``
            (default): the world size when the reader starts (kept by its state on resume);
            ``0``: one global plan over the whole cache, every rank reading from all shards.
        shuffle_block: rows a stream shuffles together: larger mixes more, and a rank plans,
            holds and fetches that many rows of each of its streams at a time.
        growth: tokens reserved for every sequence to grow by at read time: each is planned
            as ``length + growth`` tokens (with ``packing="concat"``, a document of that
            length is cut into the rows), so no batch exceeds ``max_tokens`` once a read-time
            transform lengthened it. ``ShardDataset`` raises it to its transform's
            ``max_growth``.

    Raises:
        ConfigError: a field out of range or not valid in its mode (the message names it).
    """

    max_tokens: int
    shuffle: bool = True
    pad_to_multiple_of: int = 1
    window_size: int = DEFAULT_WINDOW_SIZE
    mode: str = "pad"
    seq_len: int | None = None
    packing: str = "best_fit"
    tail: str = "drop"
    streams: int | None = None
    shuffle_block: int = DEFAULT_SHUFFLE_BLOCK
    growth: int = 0

    def __post_init__(self) -> None:
        check_int("max_tokens", self.max_tokens, 1)
        if self.max_tokens > MAX_BATCH_TOKENS:
            gib = self.max_tokens * BATCH_BYTES_PER_TOKEN / 2**30
            raise ConfigError(
                f"max_tokens: got {self.max_tokens:,}, a batch whose arrays need at least "
                f"{gib:,.1f} GiB ({BATCH_BYTES_PER_TOKEN} bytes a token: ids, labels, positions); "
                f"the most a batch may hold is {MAX_BATCH_TOKENS:,} tokens. Pass the tokens of "
                "one rank's batch (e.g. 16384), and seq_len at most that"
            )
        check_int("growth", self.growth, 0)
        if self.streams is not None:
            check_int("streams", self.streams, 0, MAX_STREAMS)
        check_int("shuffle_block", self.shuffle_block, 1)
        check_int("pad_to_multiple_of", self.pad_to_multiple_of, 1)
        check_int("window_size", self.window_size, 1)
        if not isinstance(self.shuffle, bool):
            raise ConfigError(f"shuffle: got {self.shuffle!r}, expected True or False")
        check_choice("mode", self.mode, modes())
        check_choice("packing", self.packing, packings())
        check_choice("tail", self.tail, TAILS)
        if self.mode == "pad":
            if self.seq_len is not None:
                raise ConfigError(
                    f"seq_len: got {self.seq_len!r} with mode='pad'; seq_len sets the row "
                    "length of packed batches, so pass mode='pack' or drop seq_len"
                )
            return
        if self.seq_len is None:
            raise ConfigError(
                "seq_len: mode='pack' needs seq_len (the tokens per packed row), e.g. 4096"
            )
        check_int("seq_len", self.seq_len, 1)
        if self.seq_len > self.max_tokens:
            raise ConfigError(
                f"seq_len: {self.seq_len} exceeds max_tokens={self.max_tokens}; a batch holds "
                "max_tokens // seq_len rows, so raise max_tokens or lower seq_len"
            )
        if self.pad_to_multiple_of != 1:
            raise ConfigError(
                f"pad_to_multiple_of: got {self.pad_to_multiple_of} with mode='pack'; packed "
                "rows are exactly seq_len long, so choose seq_len as the multiple instead"
            )

    @property
    def rows_per_batch(self) -> int | None:
        """Rows of a full packed batch (``None`` in pad mode, where it varies)."""
        return None if self.seq_len is None else self.max_tokens // self.seq_len

    def padded(self, length: np.ndarray | int) -> np.ndarray | int:
        """Round a length up to a multiple of ``pad_to_multiple_of``.

        Args:
            length: a length or an array of them.

        Returns:
            The same type as ``length``.
        """
        m = self.pad_to_multiple_of
        return -(-length // m) * m

    def to_json(self) -> dict[str, Any]:
        """The options as a JSON-able dict.

        Returns:
            The fields by name.
        """
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PlanOptions:
        """The options ``to_json`` gave.

        Args:
            data: the fields by name.

        Returns:
            The options, checked.

        Raises:
            ConfigError: an unknown field, or an invalid value.
        """
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ConfigError(
                f"plan options: unknown field(s) {unknown}; valid fields are {sorted(names)}"
            )
        return cls(**data)


# --------------------------------------------------------------------------------------------
# Planning
# --------------------------------------------------------------------------------------------


def plan_epoch(
    lengths: np.ndarray,
    buckets: np.ndarray,
    options: PlanOptions,
    seed: int = 0,
    epoch: int = 0,
) -> EpochPlan:
    """The ordered global batches of an epoch.

    Pad mode sorts windows of a bucket longest first and keeps a window's batches together, so
    ranks get similar lengths at a step. Pack mode fills ``seq_len`` rows by ``options.packing``.

    Args:
        lengths: every sequence's length (the length index).
        buckets: every sequence's bucket.
        options: the batch options.
        seed: the seed.
        epoch: the epoch.

    Returns:
        The plan; a function of the arguments only.

    Raises:
        ConfigError: a sequence fits no batch or best_fit row, or the arrays differ in length.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    buckets = np.asarray(buckets)
    if len(lengths) != len(buckets):
        raise ConfigError(
            f"plan: {len(lengths)} lengths but {len(buckets)} bucket ids; they must match"
        )
    if len(lengths) == 0:
        return EpochPlan(np.zeros(1, dtype=np.int64), np.zeros(0, dtype=np.int64))
    rng = np.random.default_rng([seed, epoch]) if options.shuffle else None
    return plan_sequences(lengths, buckets, options, rng)


def plan_sequences(
    lengths: np.ndarray, buckets: np.ndarray, options: PlanOptions, rng: np.random.Generator | None
) -> EpochPlan:
    """The batches of some sequences (int64 lengths, at least one) shuffled by ``rng``."""
    policy = policy_for(options.mode, options.packing)
    if options.growth:  # room for a read-time transform to lengthen every sequence
        lengths = lengths + options.growth
    return policy.plan(lengths, buckets, options, rng)


# --------------------------------------------------------------------------------------------
# Split over ranks and workers
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EpochSplit:
    """How global batches from ``start`` are dealt to ranks (``tail``: drop or wrap the rest)."""

    num_batches: int
    world_size: int
    start: int
    tail: str
    batches_per_rank: int

    def for_rank(self, rank: int) -> np.ndarray:
        """The int64 global batches rank ``rank`` yields, in order; ConfigError if out of range."""
        if not 0 <= rank < self.world_size:
            raise ConfigError(
                f"rank: got {rank}, expected 0 <= rank < world_size={self.world_size}"
            )
        virtual = self.start + rank + self.world_size * np.arange(self.batches_per_rank)
        if self.tail == "wrap" and self.num_batches:
            virtual = np.where(
                virtual < self.num_batches,
                virtual,
                (virtual - self.num_batches) % self.num_batches,
            )
        return virtual.astype(np.int64)

    @property
    def end(self) -> int:
        """The global cursor once every rank has taken all its batches."""
        return self.start + self.batches_per_rank * self.world_size

    @property
    def dropped(self) -> np.ndarray:
        """Global batches no rank delivers."""
        return np.arange(min(self.end, self.num_batches), self.num_batches, dtype=np.int64)

    @property
    def repeated(self) -> np.ndarray:
        """Global batches delivered twice."""
        extra = max(self.end - max(self.num_batches, self.start), 0)
        return (np.arange(extra, dtype=np.int64) % max(self.num_batches, 1)).astype(np.int64)


def split_epoch(
    num_batches: int, world_size: int, start: int = 0, tail: str = "drop"
) -> EpochSplit:
    """Deal an epoch's global batches to ranks from cursor ``start``, each rank the same count."""
    check_int("world_size", world_size, 1)
    check_int("num_batches", num_batches, 0)
    check_int("start", start, 0)
    check_choice("tail", tail, TAILS)
    remaining = max(num_batches - start, 0)
    per_rank = remaining // world_size if tail == "drop" else -(-remaining // world_size)
    return EpochSplit(num_batches, world_size, start, tail, per_rank)


def worker_batches(rank_batches: np.ndarray, worker_id: int, num_workers: int) -> np.ndarray:
    """A DataLoader worker's share of a rank's batches: every ``num_workers``-th one, as a view."""
    if not 0 <= worker_id < num_workers:
        raise ConfigError(
            f"worker_id: got {worker_id}, expected 0 <= worker_id < num_workers={num_workers}"
        )
    return rank_batches[worker_id::num_workers]
