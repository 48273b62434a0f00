"""Mixture schedules: weights as a function of the tokens consumed, with per-source epochs.

A schedule's run is cut into **windows**; window ``w`` is planned as one mixture epoch (epoch
number = window number), so streams, ranks, workers and resume are the epoch machinery's. Every
source reads its own endless stream of documents: pass ``c`` over the source is a permutation
seeded by (seed, source key, c). Window ``w`` takes the documents between the source's cumulative
token targets at its start and end (``round`` of the schedule's shares times the windows'
sizes, summed), each cut at the nearest document boundary. So no document is used again before
every document of its source was used, a source's tokens over any run of windows are within one
longest document of its target, and the documents of window ``w`` are a pure function of the
sources, the schedule, the seed and ``w``: computed without planning earlier windows.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from shardcache.errors import ConfigError
from shardcache.read.selection.mixture import Source, nearest_boundary
from shardcache.read.selection.mixture_table import MAX_TOKENS_PER_EPOCH, normalised_shares

#: Schedule kinds: piecewise-constant weights, or weights interpolated between points.
KINDS = ("phases", "linear")
#: A linear ramp is cut into windows of at most this share of its tokens.
LINEAR_WINDOW_SHARE = 0.01
#: The most windows a schedule may cut the run into: each is an epoch of the run, planned and
#: stored apart, so millions of them (``window_tokens=1``, or a point at 1e14 tokens) are
#: mostly empty epochs and arrays of gigabytes; past it the schedule is refused.
MAX_SCHEDULE_WINDOWS = 100_000


@dataclass(frozen=True)
class SchedulePoint:
    """Weights from ``at_tokens`` on (phases), or at ``at_tokens`` (linear).

    Attributes:
        at_tokens: the global token position (tokens of the run consumed) where it applies.
        weights: source label -> weight (>= 0; a source left out weighs 0).
    """

    at_tokens: int
    weights: dict[str, float]

    def to_json(self) -> dict[str, Any]:
        """The point as a JSON-able dict.

        Returns:
            ``at_tokens`` and ``weights``.
        """
        return {"at_tokens": self.at_tokens, "weights": dict(self.weights)}


def _point(value: Any, i: int) -> SchedulePoint:
    where = f"schedule point #{i + 1}"
    if isinstance(value, SchedulePoint):
        value = value.to_json()
    if isinstance(value, (tuple, list)) and len(value) == 2:
        value = {"at_tokens": value[0], "weights": value[1]}
    if not isinstance(value, dict):
        raise ConfigError(
            f"{where}: got {value!r}, expected {{'at_tokens': N, 'weights': {{source: w}}}}"
        )
    unknown = sorted(set(value) - {"at_tokens", "weights"})
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; the keys are at_tokens, weights")
    at = value.get("at_tokens")
    if isinstance(at, float) and at.is_integer():
        at = int(at)  # (TOML 9e11)
    if isinstance(at, bool) or not isinstance(at, int) or not 0 <= at <= MAX_TOKENS_PER_EPOCH:
        raise ConfigError(f"{where}: at_tokens={at!r}, expected an integer in [0, 2**63 - 1]")
    weights = value.get("weights")
    if not isinstance(weights, dict) or not weights:
        raise ConfigError(f"{where}: weights={weights!r}, expected a table source -> weight")
    clean = {}
    for name, w in weights.items():
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w < 0:
            raise ConfigError(f"{where}: weight of {name!r} is {w!r}, expected a number >= 0")
        clean[str(name)] = float(w)
    if not any(w > 0 for w in clean.values()):
        raise ConfigError(f"{where}: every weight is 0; give at least one source a weight > 0")
    return SchedulePoint(at, clean)


@dataclass(frozen=True)
class Schedule:
    """A mixture's weights over the run (validated at construction; see docs/guide/mixtures.md).

    Args:
        points: ``SchedulePoint``s, or mappings ``{"at_tokens": N, "weights": {label: w}}``,
            the first at 0, ``at_tokens`` strictly increasing. The weights replace the
            sources' own.
        kind: ``"phases"`` (weights constant from a point to the next) or ``"linear"``
            (interpolated between points, constant after the last).
        window_tokens: the tokens of a window (an epoch of the run); default: the largest
            window in which the first point's shares use every source at most once.
        total_tokens: where the run ends; default: where the first source reaches its
            ``max_repetitions`` (which bound a source's uses over the whole run).

    Raises:
        ConfigError: a value out of range.
    """

    points: tuple[SchedulePoint, ...]
    kind: str = "phases"
    window_tokens: int | None = None
    total_tokens: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.points, (str, dict)) or not hasattr(self.points, "__iter__"):
            raise ConfigError(f"Schedule.points: got {self.points!r}, expected a list of points")
        points = tuple(_point(p, i) for i, p in enumerate(self.points))
        object.__setattr__(self, "points", points)
        if not points or points[0].at_tokens != 0:
            first = points[0].at_tokens if points else None
            raise ConfigError(
                f"Schedule.points: the first point is at_tokens={first!r}; the schedule must "
                "start at at_tokens=0"
            )
        ats = [p.at_tokens for p in points]
        if any(b <= a for a, b in itertools.pairwise(ats)):
            raise ConfigError(
                f"Schedule.points: at_tokens {ats} must increase strictly; sort the points"
            )
        if self.kind not in KINDS:
            raise ConfigError(f"Schedule.kind: got {self.kind!r}, expected one of {KINDS}")
        for name in ("window_tokens", "total_tokens"):
            value = getattr(self, name)
            if isinstance(value, float) and value.is_integer():
                value = int(value)
                object.__setattr__(self, name, value)
            if value is not None and (
                isinstance(value, bool)
                or not isinstance(value, int)
                or not 1 <= value <= MAX_TOKENS_PER_EPOCH
            ):
                raise ConfigError(
                    f"Schedule.{name}: got {value!r}, expected an integer in [1, 2**63 - 1] or None"
                )
        if self.total_tokens is not None and self.total_tokens <= ats[-1]:
            raise ConfigError(
                f"Schedule.total_tokens={self.total_tokens:,} is not past the last point "
                f"(at_tokens={ats[-1]:,}); raise it or drop the last point"
            )

    def to_json(self) -> dict[str, Any]:
        """The schedule as a JSON-able dict (what a reader state records).

        Returns:
            ``kind``, ``window_tokens``, ``total_tokens`` and ``points``.
        """
        return {
            "kind": self.kind,
            "window_tokens": self.window_tokens,
            "total_tokens": self.total_tokens,
            "points": [p.to_json() for p in self.points],
        }

    @classmethod
    def from_json(cls, value: dict[str, Any]) -> Schedule:
        """A schedule from ``to_json``'s dict (ConfigError if it is not one)."""
        if not isinstance(value, dict):
            raise ConfigError(f"schedule: got {value!r}, expected Schedule.to_json()'s dict")
        return cls(
            tuple(value.get("points") or ()),
            value.get("kind", "phases"),
            value.get("window_tokens"),
            value.get("total_tokens"),
        )


def as_schedule(value: Any) -> Schedule | None:
    """A ``Schedule`` from a Schedule, a list of points or None."""
    if value is None or isinstance(value, Schedule):
        return value
    if isinstance(value, dict) and "points" in value:
        return Schedule.from_json(value)
    return Schedule(tuple(value))


@dataclass(frozen=True)
class PhaseRow:
    """One source in one phase of a ``ScheduleTable``.

    Attributes:
        name: the source's label.
        share: its share of the phase's tokens (a linear ramp: the mean over its windows).
        tokens: the tokens it gives in the phase (targets; delivered within a document).
        passes: its passes over its tokens by the end of the phase (cumulative).
    """

    name: str
    share: float
    tokens: int
    passes: float


@dataclass(frozen=True)
class ScheduleTable:
    """What a schedule gives each source, phase by phase (``shardcache mix`` prints it).

    Phases are numbered from 0, as windows (epochs) are: phase ``p`` is ``phases[p]``, the
    number ``phase_of`` returns and ``shardcache mix`` prints.

    Attributes:
        phases: ``(start, end, rows)`` per phase (from a point to the next, the last to the end).
        total_tokens: where the run ends.
        windows: how many windows (epochs) the run has.
        window_tokens: the tokens of a full window.
        exhausted: per source label, the token position where its passes reach 1 (None: never).
        binding: the source whose cap ends the run (None: ``total_tokens`` given).
        phase_windows: per phase, its first window and the window after its last (epochs).
    """

    phases: tuple[tuple[int, int, tuple[PhaseRow, ...]], ...]
    total_tokens: int
    windows: int
    window_tokens: int
    exhausted: dict[str, int | None] = field(default_factory=dict)
    binding: str | None = None
    phase_windows: tuple[tuple[int, int], ...] = ()

    def phase_of(self, epoch: int) -> int:
        """The phase that window (epoch) ``epoch`` belongs to.

        Args:
            epoch: a window of the run.

        Returns:
            The index into ``phases`` (from 0: the phase number ``shardcache mix`` prints).

        Raises:
            ConfigError: ``epoch`` is not a window of the run.
        """
        for p, (first, after) in enumerate(self.phase_windows):
            if first <= epoch < after:
                return p
        raise ConfigError(f"epoch {epoch}: the run has {self.windows} windows (epochs)")

    def to_json(self) -> dict[str, Any]:
        """The table as a JSON-able dict.

        Returns:
            ``total_tokens``, ``windows``, ``window_tokens``, ``binding``, ``exhausted`` and
            ``phases`` (``start``, ``end``, ``sources``).
        """
        return {
            "total_tokens": self.total_tokens,
            "windows": self.windows,
            "window_tokens": self.window_tokens,
            "binding": self.binding,
            "exhausted": dict(self.exhausted),
            "phases": [
                {
                    "start": a,
                    "end": b,
                    "windows": list(w),
                    "sources": [dict(r.__dict__) for r in rows],
                }
                for (a, b, rows), w in zip(self.phases, self.phase_windows)
            ],
        }

    def format(self) -> str:
        """The table as aligned text, a block per phase.

        Returns:
            The lines, without a final newline.
        """
        lines = []
        for i, (a, b, rows) in enumerate(self.phases):
            windows = ""
            if i < len(self.phase_windows):
                first, after = self.phase_windows[i]
                windows = f" (windows {first} .. {after - 1})"
            lines.append(f"phase {i}: tokens {a:,} .. {b:,}{windows}")
            head = ("  source", "share", "tokens", "passes")
            cells = [
                (f"  {r.name}", f"{r.share:.4f}", f"{r.tokens:,}", f"{r.passes:.4f}") for r in rows
            ]
            widths = [max(len(c[k]) for c in (head, *cells)) for k in range(4)]
            for c in (head, *cells):
                lines.append(
                    "  ".join(
                        x.ljust(w) if k == 0 else x.rjust(w)
                        for k, (x, w) in enumerate(zip(c, widths))
                    )
                )
        for name, at in self.exhausted.items():
            if at is not None:
                lines.append(f"source {name}: every document used once by token {at:,}")
        end = f"run: {self.total_tokens:,} tokens in {self.windows:,} windows of "
        end += f"<= {self.window_tokens:,}"
        if self.binding is not None:
            end += f" (ends where {self.binding} reaches its max_repetitions)"
        lines.append(end)
        return "\n".join(lines)


@dataclass(frozen=True)
class ScheduleLayout:
    """A schedule resolved against its sources: every window's place and per-source targets.

    ``starts[w]`` / ``sizes[w]``: window ``w``'s first global token and its tokens;
    ``shares[w, s]``: source ``s``'s share in it; ``cum[w, s]``: source ``s``'s tokens in
    windows ``< w`` (``cum[0] = 0``, ``windows + 1`` rows).
    """

    schedule: Schedule
    starts: np.ndarray
    sizes: np.ndarray
    shares: np.ndarray
    cum: np.ndarray
    tokens: tuple[int, ...]
    labels: tuple[str, ...]
    binding: str | None

    @property
    def windows(self) -> int:
        """The number of windows (epochs of the run)."""
        return len(self.sizes)

    def window_targets(self, window: int) -> tuple[np.ndarray, np.ndarray]:
        """Every source's cumulative target at the window's start and end (ConfigError: past it)."""
        if not 0 <= window < self.windows:
            raise ConfigError(
                f"epoch {window}: the schedule's run has {self.windows} windows (epochs 0 .. "
                f"{self.windows - 1}, {int(self.starts[-1] + self.sizes[-1]):,} tokens); "
                "iterate epochs below ds.epochs, or raise Schedule.total_tokens / the sources' "
                "max_repetitions"
            )
        return self.cum[window], self.cum[window + 1]

    def documents(
        self,
        counted: np.ndarray,
        offsets: np.ndarray,
        keys: tuple[int, ...],
        seed: int,
        window: int,
        rows: tuple[np.ndarray, ...] | None = None,
    ) -> np.ndarray:
        """The mixture ids window ``window`` plans over (``mixture_documents`` of a schedule).

        ``counted``: every mixture id's tokens; ``offsets``: the mixture id space
        (``MixtureIndex.offsets``); ``rows[s]``: source ``s``'s side of a split (None: all).
        """
        begin, end = self.window_targets(window)
        parts = []
        for s, key in enumerate(keys):
            lo, hi = int(offsets[s]), int(offsets[s + 1])
            side = None if rows is None else np.asarray(rows[s], dtype=np.int64)
            own = counted[lo:hi] if side is None else counted[lo:hi][side]
            local = window_documents(own, int(begin[s]), int(end[s]), seed, key)
            if side is not None:
                local = side[local]
            parts.append(local + lo)
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    def expected_documents(self, documents: list[int]) -> int:
        """About how many documents the largest window takes (``documents[s]`` per source)."""
        per_token = np.asarray(documents, dtype=np.float64) / np.maximum(
            np.asarray(self.tokens, dtype=np.float64), 1.0
        )
        taken = np.diff(self.cum, axis=0) @ per_token
        return int(np.ceil(taken.max())) if len(taken) else 0

    def same_until(self, other: ScheduleLayout, window: int) -> bool:
        """Whether windows ``0 .. window`` are the same in both (so are their documents)."""
        n = window + 1
        if self.windows < n or other.windows < n:
            return False
        return bool(
            np.array_equal(self.starts[:n], other.starts[:n])
            and np.array_equal(self.sizes[:n], other.sizes[:n])
            and np.array_equal(self.cum[: n + 1], other.cum[: n + 1])
        )

    def table(self) -> ScheduleTable:
        """Per phase, each source's share, tokens and passes; where each source runs out."""
        points = self.schedule.points
        end = int(self.starts[-1] + self.sizes[-1])
        bounds = [p.at_tokens for p in points if p.at_tokens < end] + [end]
        phase_of = np.searchsorted(np.asarray(bounds[1:], dtype=np.int64), self.starts, "right")
        totals = np.asarray(self.tokens, dtype=np.float64)
        phases, windows = [], []
        for p in range(len(bounds) - 1):
            sel = np.flatnonzero(phase_of == p)
            lo, hi = (int(sel[0]), int(sel[-1]) + 1) if len(sel) else (0, 0)
            given = self.cum[hi] - self.cum[lo]
            span = max(int(self.sizes[lo:hi].sum()), 1)
            rows = tuple(
                PhaseRow(
                    name=name,
                    share=float(given[s]) / span,
                    tokens=int(given[s]),
                    passes=float(self.cum[hi, s]) / totals[s],
                )
                for s, name in enumerate(self.labels)
            )
            phases.append((bounds[p], bounds[p + 1], rows))
            windows.append((lo, hi))
        exhausted: dict[str, int | None] = {}
        for s, name in enumerate(self.labels):
            w = int(np.searchsorted(self.cum[:, s], self.tokens[s], side="left"))
            if w > self.windows:
                exhausted[name] = None
                continue
            w -= 1  # the window in which the source's first pass ends
            inside = (self.tokens[s] - int(self.cum[w, s])) / max(float(self.shares[w, s]), 1e-300)
            exhausted[name] = int(self.starts[w]) + min(round(inside), int(self.sizes[w]))
        return ScheduleTable(
            tuple(phases),
            end,
            self.windows,
            int(self.sizes.max()),
            exhausted,
            self.binding,
            tuple(windows),
        )


def _weights_matrix(schedule: Schedule, labels: tuple[str, ...]) -> np.ndarray:
    """The points' weights as shares, a row per point, a column per source."""
    known = set(labels)
    rows = []
    for i, p in enumerate(schedule.points):
        unknown = sorted(set(p.weights) - known)
        if unknown:
            raise ConfigError(
                f"schedule point #{i + 1} (at_tokens={p.at_tokens:,}): weights name {unknown}, "
                f"which are not sources of the mixture {list(labels)}; use the sources' names"
            )
        rows.append(normalised_shares([p.weights.get(name, 0.0) for name in labels]))
    return np.asarray(rows, dtype=np.float64)


def _check_window_count(count: int, window: int, at: int, where: str) -> None:
    """Refuse a run of more than ``MAX_SCHEDULE_WINDOWS`` windows, before any is cut."""
    if count <= MAX_SCHEDULE_WINDOWS:
        return
    wider = -(-at // MAX_SCHEDULE_WINDOWS)
    raise ConfigError(
        f"Schedule: {count:,} windows of up to {window:,} tokens up to {where} "
        f"(at_tokens={at:,}), past the {MAX_SCHEDULE_WINDOWS:,} that can be planned: each "
        "window is an epoch of the run, planned apart (millions of them are arrays of "
        "gigabytes, and mostly empty epochs when a window is smaller than a batch). Give "
        f"window_tokens={wider:,} or more, or points and total_tokens within "
        f"{MAX_SCHEDULE_WINDOWS:,} windows"
    )


def resolve_schedule(
    schedule: Schedule, sources: tuple[Source, ...], tokens: list[int]
) -> ScheduleLayout:
    """Cut the run into windows and give each source its cumulative targets.

    ``tokens[s]``: what source ``s`` gives the mixture (its cache, or its side of a split).
    ConfigError: a point names no source, or the run needs more of a source than its cap.
    """
    labels = tuple(s.label for s in sources)
    shares_at = _weights_matrix(schedule, labels)
    caps = np.asarray([s.max_repetitions * n for s, n in zip(sources, tokens)], dtype=np.float64)
    window = schedule.window_tokens
    if window is None:  # the first point's shares, every source at most once
        first = shares_at[0]
        fits = [n / f for n, f in zip(tokens, first) if f > 0]
        window = max(1, math.floor(min(fits)))
    ats = [p.at_tokens for p in schedule.points]
    linear = schedule.kind == "linear"

    def cut(a: int, b: int, size: int) -> np.ndarray:
        count = -(-(b - a) // size)
        return np.minimum(a + size * np.arange(count + 1, dtype=np.int64), b)

    # windows up to the last point (each segment between two points on its own)
    segments = []
    for a, b in itertools.pairwise(ats):
        size = window
        if linear:
            size = max(1, min(window, math.ceil((b - a) * LINEAR_WINDOW_SHARE)))
        segments.append((a, b, size))
    counted = sum(-(-(b - a) // size) for a, b, size in segments)
    _check_window_count(counted, window, ats[-1], "its last point")
    edges = [np.zeros(1, dtype=np.int64)]
    for a, b, size in segments:
        edges.append(cut(a, b, size)[1:])
    fixed = np.concatenate(edges)
    starts, ends = fixed[:-1], fixed[1:]
    shares = _window_shares(shares_at, ats, starts, ends, linear)
    used = (shares * (ends - starts)[:, None]).sum(axis=0)
    over = used - caps
    worst = int(np.argmax(over / np.maximum(caps, 1)))
    if over[worst] > 0.5:
        raise _over_cap(sources[worst], tokens[worst], used[worst], ats[-1], "its last point")
    last = shares_at[-1]
    binding = None
    total = schedule.total_tokens
    if total is None:  # where the first source reaches its cap under the last point's shares
        room = [(c - u) / f if f > 0 else math.inf for c, u, f in zip(caps, used, last)]
        s = int(np.argmin(room))
        if not math.isfinite(room[s]) or ats[-1] + room[s] > MAX_TOKENS_PER_EPOCH:
            raise ConfigError(
                "Schedule: no source's max_repetitions ends the run before 2**63 tokens; give "
                "Schedule(total_tokens=...)"
            )
        total, binding = ats[-1] + math.floor(room[s]), labels[s]
        if total <= ats[-1]:
            raise _over_cap(sources[s], tokens[s], used[s] + 1, ats[-1] + 1, "the last point")
    _check_window_count(counted + -(-(total - ats[-1]) // window), window, total, "the run's end")
    tail = cut(ats[-1], total, window)
    starts = np.concatenate([starts, tail[:-1]])
    ends = np.concatenate([ends, tail[1:]])
    shares = np.concatenate([shares, np.repeat(last[None, :], len(tail) - 1, axis=0)])
    sizes = ends - starts
    exact = np.cumsum(shares * sizes[:, None], axis=0)
    cum = np.zeros((len(sizes) + 1, len(labels)), dtype=np.int64)
    cum[1:] = np.rint(exact).astype(np.int64)
    for s, source in enumerate(sources):
        if cum[-1, s] > math.floor(caps[s]) + 1:
            raise _over_cap(source, tokens[s], float(cum[-1, s]), total, "the run's end")
    return ScheduleLayout(schedule, starts, sizes, shares, cum, tuple(tokens), labels, binding)


def _window_shares(
    shares_at: np.ndarray, ats: list[int], starts: np.ndarray, ends: np.ndarray, linear: bool
) -> np.ndarray:
    """Every window's shares: its phase's, or (linear) interpolated at its midpoint."""
    point = np.searchsorted(np.asarray(ats, dtype=np.int64), starts, side="right") - 1
    if not linear or len(ats) < 2:
        return shares_at[point]
    mid = (starts + ends) / 2.0
    nxt = np.minimum(point + 1, len(ats) - 1)
    a = np.asarray(ats, dtype=np.float64)[point]
    b = np.asarray(ats, dtype=np.float64)[nxt]
    t = np.where(b > a, (mid - a) / np.where(b > a, b - a, 1.0), 0.0)[:, None]
    mixed = shares_at[point] * (1 - t) + shares_at[nxt] * t
    return mixed / mixed.sum(axis=1, keepdims=True)


def _over_cap(source: Source, tokens: int, used: float, at: int, where: str) -> ConfigError:
    cap = source.max_repetitions * tokens
    return ConfigError(
        f"schedule: source {source.label!r} ({source.path}) would give {round(used):,} tokens "
        f"by token {at:,} ({where}), {used / tokens:.4g} passes over its {tokens:,}, but "
        f"max_repetitions={source.max_repetitions:g} bounds it over the whole run to "
        f"{math.floor(cap):,} ({round(used - cap):,} over); raise its max_repetitions to >= "
        f"{used / tokens:.4g}, lower its weights, or "
        "end the run earlier (Schedule.total_tokens)"
    )


def schedule_changes(theirs: Any, ours: dict[str, Any] | None) -> list[str]:
    """The differences between a recorded schedule (``Schedule.to_json``) and ours, a line each."""
    if theirs is None or ours is None:
        return [f"schedule: {'none' if theirs is None else 'a schedule'} -> "
                f"{'none' if ours is None else 'a schedule'}"]  # fmt: skip
    if not isinstance(theirs, dict):
        return [f"schedule: {theirs!r} -> {ours!r}"]
    lines = [
        f"{name}: {theirs.get(name)!r} -> {ours[name]!r}"
        for name in ("kind", "window_tokens", "total_tokens")
        if theirs.get(name) != ours[name]
    ]
    old = {p.get("at_tokens"): p.get("weights") for p in theirs.get("points") or []}
    new = {p["at_tokens"]: p["weights"] for p in ours["points"]}
    for at in sorted({*old, *new}, key=lambda x: (not isinstance(x, int), x)):
        if at not in new:
            lines.append(f"point at_tokens={at}: removed")
        elif at not in old:
            lines.append(f"point at_tokens={at}: added {new[at]}")
        elif old[at] != new[at]:
            lines.append(f"point at_tokens={at}: weights {old[at]} -> {new[at]}")
    return lines


def _pass_order(n: int, seed: int, key: int, cycle: int) -> np.ndarray:
    """Pass ``cycle``'s order of a source's ``n`` documents."""
    return np.random.default_rng([seed, key, cycle]).permutation(n).astype(np.int64)


def window_documents(lengths: np.ndarray, first: int, last: int, seed: int, key: int) -> np.ndarray:
    """The local ids between token positions ``first`` and ``last`` of a source's endless stream.

    The stream is pass 0, pass 1, ... of the source's documents, each pass a permutation; both
    positions are moved to the nearest document boundary.
    """
    n = len(lengths)
    total = int(np.sum(lengths, dtype=np.int64))
    if n == 0 or last <= first:
        return np.zeros(0, dtype=np.int64)
    bounds_of: dict[int, np.ndarray] = {}
    orders: dict[int, np.ndarray] = {}

    def order(cycle: int) -> np.ndarray:
        if cycle not in orders:
            orders[cycle] = _pass_order(n, seed, key, cycle)
            bounds = np.zeros(n + 1, dtype=np.int64)
            np.cumsum(lengths[orders[cycle]], out=bounds[1:])
            bounds_of[cycle] = bounds
        return orders[cycle]

    def boundary(position: int) -> int:  # a document index in the endless stream
        cycle, inside = divmod(position, total)
        order(cycle)
        return cycle * n + nearest_boundary(bounds_of[cycle], inside)

    lo, hi = boundary(first), boundary(last)
    parts = []
    for cycle in range(lo // n, (hi - 1) // n + 1 if hi > lo else lo // n):
        a, b = max(lo, cycle * n) - cycle * n, min(hi, (cycle + 1) * n) - cycle * n
        if b > a:
            parts.append(order(cycle)[a:b])
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
