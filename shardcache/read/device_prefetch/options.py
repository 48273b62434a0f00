"""The prefetcher's options (``PrefetchOptions``) and metrics (``PrefetchStats``).

Reading the metrics: high ``source_wait_s`` means the upstream is the bottleneck; high
``consumer_wait_s`` with low ``source_wait_s`` means packing or transfer; high
``slot_wait_s`` with no ``consumer_wait_s`` is the healthy, compute-bound case.
"""

from __future__ import annotations

import dataclasses

from shardcache.config import check_int
from shardcache.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class PrefetchOptions:
    """Less common knobs of ``DevicePrefetcher``, validated at construction.

    Args:
        max_pinned_bytes: pinned host memory of all ``depth + 1`` slots together; a larger batch
            raises ``ConfigError``.
        min_slot_bytes: the smallest slot (slots grow in powers of two).
        copy_stream_priority: the copy stream's priority (lower = higher on CUDA).
        timing: record timing events around each copy for ``stats()``.
        poll_interval_s: timeout of every blocking wait between stop-flag checks.
        join_timeout_s: how long ``close()`` waits for the packer thread.

    Raises:
        ConfigError: a field out of range.
    """

    max_pinned_bytes: int = 1 << 30
    min_slot_bytes: int = 1 << 16
    copy_stream_priority: int = 0
    timing: bool = True
    poll_interval_s: float = 0.05
    join_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        check_int("PrefetchOptions.max_pinned_bytes", self.max_pinned_bytes, 1, unit="bytes")
        check_int("PrefetchOptions.min_slot_bytes", self.min_slot_bytes, 1, unit="bytes")
        check_int("PrefetchOptions.copy_stream_priority", self.copy_stream_priority, -64, 64)
        if not isinstance(self.timing, bool):
            raise ConfigError(
                f"PrefetchOptions.timing: got {self.timing!r}, expected True or False"
            )
        for name, lo, hi in (("poll_interval_s", 1e-4, 10.0), ("join_timeout_s", 1e-3, 3600.0)):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not lo <= value <= hi
            ):
                raise ConfigError(
                    f"PrefetchOptions.{name}: got {value!r}, expected a number of seconds "
                    f"in [{lo}, {hi}]"
                )


@dataclasses.dataclass(frozen=True)
class PrefetchStats:
    """A snapshot of the prefetcher's counters (cumulative since construction).

    Times are host seconds. The ``copy_*`` counters cover the copies whose timing events had
    completed when last looked at, so they lag a few batches behind ``batches``.

    Attributes:
        passthrough: no accelerator: batches pass through unchanged.
        batches: batches handed out.
        bytes_copied: bytes copied to the device.
        consumer_wait_s: the stall: time ``next()`` waited for the packer.
        consumer_wait_max_s: the longest such wait.
        consumer_next_s: all host time in ``next()``.
        source_wait_s: time the packer waited for the upstream iterator.
        pack_s: time the packer spent copying batches into pinned slots.
        slot_wait_s: time the packer waited for a free slot.
        queue_depth_mean: batches ready ahead of the consumer, on average per ``next()``.
        queue_depth_min: the fewest ready ahead at a ``next()`` (0: it starved).
        copies_timed: copies whose device time is counted in ``copy_s``.
        copy_s: device time of those copies.
        copy_bytes_timed: their bytes.
        pinned_bytes: pinned host memory held by the slots now.
        slots: pinned slots now.
        slot_grows: times a slot was (re)allocated larger.
    """

    passthrough: bool
    batches: int
    bytes_copied: int
    consumer_wait_s: float
    consumer_wait_max_s: float
    consumer_next_s: float
    source_wait_s: float
    pack_s: float
    slot_wait_s: float
    queue_depth_mean: float
    queue_depth_min: int
    copies_timed: int
    copy_s: float
    copy_bytes_timed: int
    pinned_bytes: int
    slots: int
    slot_grows: int

    @property
    def copy_gbps(self) -> float:
        """Achieved H2D bandwidth over the timed copies, in GB/s (1e9 bytes); 0 when none."""
        return self.copy_bytes_timed / self.copy_s / 1e9 if self.copy_s > 0 else 0.0

    @property
    def mean_copy_ms(self) -> float:
        """Mean device time of one timed copy in milliseconds; 0 when none."""
        return 1e3 * self.copy_s / self.copies_timed if self.copies_timed else 0.0
