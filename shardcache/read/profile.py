"""``shardcache profile``: the real reader against a simulated training step, over a few settings.

Each setting (DataLoader workers, read-ahead, prefetch depth) reads ``batches`` batches
through ``shardcache.loader`` wrapped in a ``StallMonitor``, sleeping ``step_ms`` per batch in
place of the model. The first batch (worker start-up, the plan) is reported on its own; the
wait share and stage times are over the batches after it, so a setting is judged on its
steady state. The recommendation is the setting with the lowest wait share (ties: the first
in the order given, i.e. the cheapest when the lists are in increasing order). Without a step
(``step_ms=0``) there is none: the loop is then the reader alone, whose wait share is ~100%
at any setting and says nothing of a real step; the report names the fastest reader instead.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

from shardcache.config import check_int
from shardcache.errors import ConfigError
from shardcache.read.device_prefetch import DevicePrefetcher, StallMonitor
from shardcache.read.device_prefetch.prefetcher import MAX_DEPTH
from shardcache.read.loader import ShardLoader, loader

#: The stage figures of a row (``StallMonitor.step`` names), in pipeline order.
STAGES = ("plan_s", "fetch_s", "gather_s", "collate_s", "pin_s", "copy_s")
#: The longest simulated step: an hour (a longer one is a typo, and ``inf`` cannot be slept).
MAX_STEP_MS = 3_600_000.0


@dataclasses.dataclass(frozen=True)
class ProfileOptions:
    """What ``profile_reader`` runs, validated at construction.

    Args:
        step_ms: the simulated training step per batch, in milliseconds (0 to an hour); 0
            simulates none: the rows time the reader alone and nothing is recommended.
        batches: batches read per setting after the first (>= 1).
        workers: DataLoader worker counts to try.
        readahead: read-ahead shard counts to try (None: the reader's default).
        depth: prefetch depths to try (None: no ``DevicePrefetcher``); needs ``device``.
        device: the device a ``DevicePrefetcher`` copies to, or None.

    Raises:
        ConfigError: a field out of range, or ``depth`` without ``device``.
    """

    step_ms: float = 0.0
    batches: int = 50
    workers: tuple[int, ...] = (0, 1, 2, 4)
    readahead: tuple[int | None, ...] = (None,)
    depth: tuple[int | None, ...] = (None,)
    device: str | None = None

    def __post_init__(self) -> None:
        value = self.step_ms
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not 0 <= value <= MAX_STEP_MS
        ):
            raise ConfigError(
                f"step_ms: got {value!r}, expected a number of milliseconds from 0 to "
                f"{MAX_STEP_MS:,.0f} (an hour): the time a training step takes"
            )
        check_int("batches", self.batches, 1)
        for name in ("workers", "readahead", "depth"):
            if not getattr(self, name):
                raise ConfigError(f"{name}: got an empty list, expected at least one value")
        for n in self.workers:
            check_int("workers", n, 0)
        for n in self.readahead:
            if n is not None:
                check_int("readahead", n, 0)
        for n in self.depth:
            if n is not None:
                check_int("depth", n, 1, MAX_DEPTH)
        if self.device is None and any(d is not None for d in self.depth):
            raise ConfigError(
                f"depth: got {list(self.depth)} without a device; a prefetch depth needs a "
                "DevicePrefetcher: pass a device (e.g. 'cuda') or leave depth out"
            )

    def settings(self) -> list[dict[str, Any]]:
        """Every combination, workers varying slowest."""
        return [
            {"workers": w, "readahead": r, "depth": d}
            for w in self.workers
            for r in self.readahead
            for d in self.depth
        ]


def _open(path: str, max_tokens: int, setting: dict[str, Any], options: ProfileOptions,
          reader: dict[str, Any]) -> ShardLoader:  # fmt: skip
    """A loader for one setting (with a prefetcher of the setting's depth when it has one)."""
    opened = loader(path, max_tokens, num_workers=setting["workers"],
                    readahead=setting["readahead"], **reader)  # fmt: skip
    if setting["depth"] is None:
        return opened
    prefetcher = DevicePrefetcher(opened.dataloader, options.device, setting["depth"])
    return ShardLoader(opened.dataset, opened.dataloader, prefetcher)


def _run_setting(batches: ShardLoader, options: ProfileOptions) -> dict[str, Any]:
    """Read ``options.batches`` batches after the first, sleeping ``step_ms`` per batch."""
    monitor = StallMonitor(ranks=False, warn_pct=None)  # (the table recommends instead)
    sums: dict[str, float] = {}
    taken = epochs = 0
    first_s: float | None = None
    while taken < options.batches:
        yielded = 0
        for _ in monitor.wrap(batches):
            yielded += 1
            time.sleep(options.step_ms / 1e3)
            figures = monitor.step()
            if first_s is None:
                first_s = figures["data_loading_s"]
                continue
            for name, value in figures.items():
                sums[name] = sums.get(name, 0.0) + value
            taken += 1
            if taken == options.batches:
                break
        if yielded == 0:
            raise ConfigError(
                f"profile: epoch {epochs} yields no batch at this rank under these options; "
                "check the cache (shardcache info) and --max-tokens"
            )
        epochs += 1
        batches.set_epoch(epochs)
    step_s = sums.get("step_s", 0.0)
    loading = sums.get("data_loading_s", 0.0)
    row: dict[str, Any] = {
        "batches": taken,
        "first_batch_s": first_s or 0.0,
        "step_ms": 1e3 * step_s / taken,
        "wait_pct": min(max(100.0 * loading / step_s, 0.0), 100.0) if step_s > 0 else 0.0,
        "wait_ms": 1e3 * loading / taken,
        "wait_reader_ms": 1e3 * sums.get("wait_reader_s", 0.0) / taken,
        "wait_copy_ms": 1e3 * sums.get("wait_copy_s", 0.0) / taken,
    }
    for stage in STAGES:
        row[stage[:-2] + "_ms"] = 1e3 * sums.get(stage, 0.0) / taken
    return row


def profile_reader(
    path: str,
    max_tokens: int,
    options: ProfileOptions,
    reader: dict[str, Any] | None = None,
    progress: Callable[[int, int, dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Run every setting of ``options`` and recommend one (``shardcache profile``).

    Args:
        path: the cache folder or URL.
        max_tokens: the token budget of a batch.
        options: the step, the batches per setting and the settings to try.
        reader: other ``ShardDataset`` keywords (``mode``, ``seq_len``, ``attention``, ...).
        progress: called as ``progress(i, n, setting)`` before setting ``i`` of ``n`` runs.

    Returns:
        ``{"rows": [...], "recommended": index, "fastest": index, "dominant": stage}``: per
        setting its ``workers``, ``readahead``, ``depth``, ``wait_pct`` (percent of the step
        spent in the loader's ``next()``), ``wait_ms`` and its split ``wait_reader_ms`` /
        ``wait_copy_ms``, the stage times per batch (``plan_ms`` ... ``copy_ms``), ``step_ms``
        and ``first_batch_s``. ``recommended`` is the row with the lowest wait share, None
        without a step (``options.step_ms == 0``); ``fastest`` the row with the least wait per
        batch (the fastest reader); ``dominant`` the largest stage of the recommended row (of
        the fastest without a step).

    Raises:
        ConfigError: an option is invalid.
        ShardcacheError: the cache cannot be read.
    """
    reader = dict(reader or {})
    settings = options.settings()
    rows = []
    for i, setting in enumerate(settings):
        if progress is not None:
            progress(i, len(settings), setting)
        with _open(path, max_tokens, setting, options, reader) as batches:
            rows.append({**setting, **_run_setting(batches, options)})
    fastest = min(range(len(rows)), key=lambda i: (rows[i]["wait_ms"], i))
    best = None
    if options.step_ms > 0:  # (without a step every wait share is the whole loop's)
        best = min(range(len(rows)), key=lambda i: (rows[i]["wait_pct"], i))
    judged = rows[fastest if best is None else best]
    stage_ms = {s[:-2]: judged[s[:-2] + "_ms"] for s in STAGES}
    return {
        "step_ms": options.step_ms,
        "max_tokens": max_tokens,
        "rows": rows,
        "recommended": best,
        "fastest": fastest,
        "dominant": max(stage_ms, key=lambda s: stage_ms[s]),
    }


def _setting_text(row: dict[str, Any]) -> str:
    readahead = "default" if row["readahead"] is None else str(row["readahead"])
    depth = "-" if row["depth"] is None else str(row["depth"])
    return f"workers={row['workers']} readahead={readahead} depth={depth}"


def format_profile(report: dict[str, Any]) -> str:
    """The table of ``profile_reader``'s rows and its recommendation, for a terminal."""
    head = ["workers", "readahead", "depth", "wait %", "wait ms", "reader ms", "copy-wait ms"]
    head += [s[:-2] + " ms" for s in STAGES] + ["1st batch s"]
    lines = [head]
    for row in report["rows"]:
        cells = [str(row["workers"]),
                 "default" if row["readahead"] is None else str(row["readahead"]),
                 "-" if row["depth"] is None else str(row["depth"]),
                 f"{row['wait_pct']:.1f}", f"{row['wait_ms']:.2f}",
                 f"{row['wait_reader_ms']:.2f}", f"{row['wait_copy_ms']:.2f}"]  # fmt: skip
        cells += [f"{row[s[:-2] + '_ms']:.2f}" for s in STAGES] + [f"{row['first_batch_s']:.2f}"]
        lines.append(cells)
    widths = [max(len(line[c]) for line in lines) for c in range(len(head))]
    table = ["  ".join(cell.rjust(w) for cell, w in zip(line, widths)) for line in lines]
    dominant = report["dominant"]
    advice = {
        "plan": "planning the pass (charged to a pass's first batch; more batches per pass)",
        "fetch": "waiting for downloads (read further ahead: --readahead, ReadAheadOptions)",
        "gather": "reading sequences (more workers, or a cache the compiled kernels read)",
        "collate": "padding / packing (more workers)",
        "pin": "packing into pinned memory (a deeper prefetch)",
        "copy": "the host-to-device copy (a deeper prefetch)",
    }[dominant]
    table.append("")
    if report["recommended"] is None:
        fastest = report["rows"][report["fastest"]]
        table.append(
            "no recommendation: no --step-ms was given, so no training step was simulated and "
            "every setting's wait share is the reader's own loop (~100%), which says nothing of "
            f"a real step. The fastest reader here is {_setting_text(fastest)} "
            f"({fastest['wait_ms']:.2f} ms a batch; the largest stage is {dominant}, "
            f"{fastest[dominant + '_ms']:.2f} ms: {advice}). Run again with --step-ms set to "
            "your model's step time (forward and backward, in ms) for the setting that keeps "
            "the step from waiting"
        )
        return "\n".join(table)
    best = report["rows"][report["recommended"]]
    table.append(
        f"recommended: {_setting_text(best)}: the step waits {best['wait_pct']:.1f}% of "
        f"{best['step_ms']:.1f} ms for data; the largest stage is {dominant} "
        f"({best[dominant + '_ms']:.2f} ms a batch): {advice}"
    )
    return "\n".join(table)
