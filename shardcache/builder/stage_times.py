"""Where a build's time goes: CPU seconds per stage, always on, shown in the build report.

Timed with the running thread's CPU clock per chunk or batch, never per record. ``tokenizer``
is the rest of a partition's process CPU (native encode and verify threads); ``*_busy`` are
the wall seconds of those calls. The figures never go into the cache.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator, Mapping

#: The stages, in pipeline order (the report lists them so).
STAGES = (
    "startup",
    "read",
    "parse",
    "tokenizer",
    "bucket",
    "write",
    "commit",
    "encode_busy",
    "verify_busy",
    "process",
)


class StageTimes:
    """Seconds per stage, added from any thread (a lock guards the sums)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.seconds: dict[str, float] = {}

    def add(self, stage: str, seconds: float) -> None:
        """Add seconds to a stage (thread-safe)."""
        with self._lock:
            self.seconds[stage] = self.seconds.get(stage, 0.0) + seconds

    def merge(self, other: Mapping[str, float]) -> None:
        """Add every stage of another partition's ``to_json()``."""
        for stage, seconds in other.items():
            self.add(stage, float(seconds))

    @contextlib.contextmanager
    def cpu(self, stage: str) -> Iterator[None]:
        """Add the calling thread's CPU seconds in the ``with`` block to a stage."""
        start = time.thread_time()
        try:
            yield
        finally:
            self.add(stage, time.thread_time() - start)

    @contextlib.contextmanager
    def busy(self, stage: str) -> Iterator[None]:
        """Add the wall seconds of the ``with`` block to a stage (CPU spent in native threads)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(stage, time.perf_counter() - start)

    def to_json(self) -> dict[str, float]:
        """``{stage: seconds}`` in ``STAGES`` order (then any other), rounded to ms."""
        with self._lock:
            order = [s for s in STAGES if s in self.seconds]
            order += sorted(s for s in self.seconds if s not in STAGES)
            return {s: round(self.seconds[s], 3) for s in order}


def format_stages(seconds: Mapping[str, float]) -> list[str]:
    """The build report's ``cpu`` line (seconds and share per stage); none when nothing ran."""
    shown = ("startup", "read", "parse", "tokenizer", "bucket", "write", "commit")
    total = sum(seconds.get(s, 0.0) for s in shown)
    if total <= 0:
        return []
    parts = [
        f"{s} {seconds[s]:.2f}s ({100 * seconds[s] / total:.0f}%)" for s in shown if s in seconds
    ]
    busy = [f"{s.removesuffix('_busy')} {seconds[s]:.2f}s" for s in ("encode_busy", "verify_busy")
            if s in seconds]  # fmt: skip
    line = "cpu          " + ", ".join(parts)
    return [line + (f"; in the tokenizer: {', '.join(busy)} busy" if busy else "")]
