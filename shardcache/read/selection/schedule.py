"""Mixture schedules: weights as a function of the tokens consumed, with per-source epochs.

A schedule's run is cut into **windows**; window ``w`` is planned as one mixture epoch (epoch
number = window number), so streams, ranks, workers and resume are the epoch machinery's. Every
source reads its own endless stream of documents: pass ``c`` over the source is a permutation
seeded by (seed, source key, c). Window ``w`` takes the documents between the source's cumulative
token targets at its start and end (its share integrated over the run's tokens up to there,
exactly, then rounded: a phase's share times its tokens; in a linear ramp, where a share is
linear between two points, a window's share at its midpoint times its tokens), each cut at the
nearest document boundary. So no document is used again before every document of its source
was used, a source's tokens over any run of windows are within one longest document of its
target, and the documents of window ``w`` are a pure function of the sources, the schedule,
the seed and ``w``: computed without planning earlier windows. No window is materialised
either: a window's place, shares and targets come from the points (``ScheduleLayout``), in time
and memory independent of the run's length, so a point may be anywhere below 2**63 tokens.

A point may also set the batch options of its phase (``PHASE_OPTIONS``: a length phase, or a
context-extension stage): they hold from the point to the next point that sets others, in both
kinds (piecewise constant, never interpolated). Every point starts a segment of windows, so no
window straddles a change of options: a window is planned and collated with its point's.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import itertools
import math
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import numpy as np

from shardcache.config import check_choice, check_int
from shardcache.errors import ConfigError
from shardcache.read.plan.epoch_plan import MAX_BATCH_TOKENS, PlanOptions
from shardcache.read.plan.policies import modes, packings
from shardcache.read.selection.mixture import Source
from shardcache.read.selection.mixture_table import MAX_TOKENS_PER_EPOCH, normalised_shares
from shardcache.read.selection.passes import SourceEpoch, SourceUnits, stream_window

#: Schedule kinds: piecewise-constant weights, or weights interpolated between points.
KINDS = ("phases", "linear")
#: A linear ramp is cut into windows of at most this share of its tokens.
LINEAR_WINDOW_SHARE = 0.01
#: The batch options (``PlanOptions`` fields) a schedule point may set for its phase.
PHASE_OPTIONS = ("max_tokens", "mode", "seq_len", "packing")


@dataclass(frozen=True)
class SchedulePoint:
    """Weights from ``at_tokens`` on (phases), or at ``at_tokens`` (linear).

    Attributes:
        at_tokens: the global token position (tokens of the run consumed) where it applies.
        weights: source label -> weight (>= 0; a source left out weighs 0).
        options: the batch options its phase sets (``PHASE_OPTIONS``: ``max_tokens``,
            ``seq_len``, ``mode``, ``packing``); the others are the previous phase's (the
            first phase's: the dataset's own).
    """

    at_tokens: int
    weights: dict[str, float]
    options: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """The point as a JSON-able dict.

        Returns:
            ``at_tokens``, ``weights`` and the batch options it sets (each by its name).
        """
        return {"at_tokens": self.at_tokens, "weights": dict(self.weights), **self.options}


def _point(value: Any, i: int, previous: SchedulePoint | None = None) -> SchedulePoint:
    where = f"schedule point #{i + 1}"
    if isinstance(value, SchedulePoint):
        value = value.to_json()
    if isinstance(value, (tuple, list)) and len(value) == 2:
        value = {"at_tokens": value[0], "weights": value[1]}
    if not isinstance(value, dict):
        raise ConfigError(
            f"{where}: got {value!r}, expected {{'at_tokens': N, 'weights': {{source: w}}}}"
        )
    unknown = sorted(set(value) - {"at_tokens", "weights", *PHASE_OPTIONS})
    if unknown:
        raise ConfigError(
            f"{where}: unknown key(s) {unknown}; the keys are at_tokens, weights and the batch "
            f"options a phase may set ({', '.join(PHASE_OPTIONS)})"
        )
    at = value.get("at_tokens")
    if isinstance(at, float) and at.is_integer():
        at = int(at)  # (TOML 9e11)
    if isinstance(at, bool) or not isinstance(at, int) or not 0 <= at <= MAX_TOKENS_PER_EPOCH:
        raise ConfigError(f"{where}: at_tokens={at!r}, expected an integer in [0, 2**63 - 1]")
    where = f"{where} (at_tokens={at:,})"
    options = _phase_options({k: value[k] for k in PHASE_OPTIONS if k in value}, where)
    weights = value.get("weights")
    if weights is None and previous is not None:  # a point that changes only batch options
        weights = previous.weights
    if not isinstance(weights, dict) or not weights:
        raise ConfigError(f"{where}: weights={weights!r}, expected a table source -> weight")
    clean = {}
    for name, w in weights.items():
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w < 0:
            raise ConfigError(f"{where}: weight of {name!r} is {w!r}, expected a number >= 0")
        clean[str(name)] = float(w)
    if not any(w > 0 for w in clean.values()):
        raise ConfigError(f"{where}: every weight is 0; give at least one source a weight > 0")
    return SchedulePoint(at, clean, options)


def _phase_options(options: dict[str, Any], where: str) -> dict[str, Any]:
    """A point's batch options, each checked alone and against the point's others.

    What also depends on the phases before (a ``seq_len`` over an inherited ``max_tokens``)
    is checked by ``Schedule.phase_options`` against the dataset's options.
    """
    try:
        for name in ("max_tokens", "seq_len"):
            value = options.get(name)
            if isinstance(value, float) and value.is_integer():
                value = options[name] = int(value)  # (TOML 1e6)
            if name in options:
                check_int(name, value, 1, MAX_BATCH_TOKENS)
        if "mode" in options:
            check_choice("mode", options["mode"], modes())
        if "packing" in options:
            check_choice("packing", options["packing"], packings())
    except ConfigError as err:
        raise ConfigError(f"{where}: {err} (a batch option of the phase)") from None
    if options.get("mode") == "pad" and "seq_len" in options:
        raise ConfigError(
            f"{where}: seq_len={options['seq_len']!r} with mode='pad'; seq_len sets the row "
            "length of packed batches, so set mode='pack' or drop seq_len"
        )
    seq_len, budget = options.get("seq_len"), options.get("max_tokens")
    if seq_len is not None and budget is not None and seq_len > budget:
        raise ConfigError(
            f"{where}: seq_len={seq_len:,} exceeds max_tokens={budget:,}; a batch holds "
            "max_tokens // seq_len rows, so raise the point's max_tokens or lower its seq_len"
        )
    return dict(sorted(options.items()))


@dataclass(frozen=True)
class Schedule:
    """A mixture's weights over the run (validated at construction; see docs/guide/mixtures.md).

    Args:
        points: ``SchedulePoint``s, or mappings ``{"at_tokens": N, "weights": {label: w}}``,
            the first at 0, ``at_tokens`` strictly increasing. The weights replace the
            sources' own (a point after the first without weights keeps the previous
            point's). A mapping may also set its phase's batch options (``max_tokens``,
            ``seq_len``, ``mode``, ``packing``): from that point on, until a point sets
            others, windows are planned and collated with them (in both kinds: options
            change at points only); the first phase's default is the dataset's options.
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
        points: tuple[SchedulePoint, ...] = ()
        for i, p in enumerate(self.points):
            points = (*points, _point(p, i, points[-1] if points else None))
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

    def options_at(self, point: int) -> dict[str, Any]:
        """The batch options phase ``point`` sets, its own and those it inherits.

        A point that sets ``mode="pad"`` ends an inherited ``seq_len`` (pad rows have none).

        Args:
            point: an index into ``points``.

        Returns:
            The options by name (empty: the dataset's own).
        """
        merged: dict[str, Any] = {}
        for p in self.points[: point + 1]:
            if p.options.get("mode") == "pad":
                merged.pop("seq_len", None)
            merged.update(p.options)
        return dict(sorted(merged.items()))

    @property
    def sets_options(self) -> bool:
        """Whether any point sets batch options (else every window has the dataset's)."""
        return any(p.options for p in self.points)

    def phase_options(self, base: PlanOptions, point: int) -> PlanOptions:
        """The batch options of phase ``point``: ``base`` (the dataset's) with the phase's.

        A packed phase of a padded dataset packs without ``pad_to_multiple_of`` (it applies
        to pad phases), and a padded phase of a packed one has no ``seq_len``.

        Args:
            base: the dataset's batch options.
            point: an index into ``points``.

        Returns:
            The options its windows are planned and collated with.

        Raises:
            ConfigError: the phase's options are not valid together with those it inherits
                (the message names the point, the options and what to change).
        """
        changes = self.options_at(point)
        if not changes:
            return base
        mode = changes.get("mode", base.mode)
        if mode == "pad" and "seq_len" not in changes:
            changes["seq_len"] = None
        if mode == "pack" and base.mode == "pad":
            changes["pad_to_multiple_of"] = 1
        try:
            return dataclasses.replace(base, **changes)
        except ConfigError as err:
            p = self.points[point]
            raise ConfigError(
                f"schedule point #{point + 1} (at_tokens={p.at_tokens:,}): its phase's batch "
                f"options {self.options_at(point)} over the dataset's (max_tokens="
                f"{base.max_tokens:,}, mode={base.mode!r}, seq_len={base.seq_len!r}, "
                f"packing={base.packing!r}) are not valid: {err}. Set the options on the point "
                "(or an earlier one), or change the dataset's"
            ) from None

    def every_phase_options(self, base: PlanOptions) -> tuple[PlanOptions, ...]:
        """Every phase's batch options (``phase_options`` of each point, checked).

        Args:
            base: the dataset's batch options.

        Returns:
            A ``PlanOptions`` per point.

        Raises:
            ConfigError: a phase's options are not valid (as ``phase_options``).
        """
        return tuple(self.phase_options(base, i) for i in range(len(self.points)))

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
        options: per phase, its batch options (``max_tokens``, ``mode``, ``seq_len``,
            ``packing``), when a point sets any (else empty: every phase has the dataset's).
    """

    phases: tuple[tuple[int, int, tuple[PhaseRow, ...]], ...]
    total_tokens: int
    windows: int
    window_tokens: int
    exhausted: dict[str, int | None] = field(default_factory=dict)
    binding: str | None = None
    phase_windows: tuple[tuple[int, int], ...] = ()
    options: tuple[dict[str, Any], ...] = ()

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
            ``phases`` (``start``, ``end``, ``windows``, ``sources``, and ``options`` when a
            point sets batch options).
        """
        phases = [
            {
                "start": a,
                "end": b,
                "windows": list(w),
                "sources": [dict(r.__dict__) for r in rows],
            }
            for (a, b, rows), w in zip(self.phases, self.phase_windows)
        ]
        for phase, options in zip(phases, self.options):
            phase["options"] = dict(options)
        return {
            "total_tokens": self.total_tokens,
            "windows": self.windows,
            "window_tokens": self.window_tokens,
            "binding": self.binding,
            "exhausted": dict(self.exhausted),
            "phases": phases,
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
            if i < len(self.options):
                lines.append(f"  batches: {_options_text(self.options[i])}")
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


def _options_text(options: dict[str, Any]) -> str:
    """A phase's batch options on a line (a padded phase without seq_len and packing)."""
    padded = options.get("mode") == "pad"
    return ", ".join(
        f"{k}={v:,}" if isinstance(v, int) else f"{k}={v}"
        for k, v in options.items()
        if v is not None and not (padded and k == "packing")
    )


def _exact_bits(shares: np.ndarray) -> int:
    """The fewest bits ``b`` for which every share times ``2**b`` is an integer.

    A float64 ``m * 2**e`` (``frexp``: ``0.5 <= m < 1``, 53 bits of ``m``) is an integer over
    ``2**(53 - e)``.
    """
    positive = shares[shares > 0]
    if not len(positive):
        return 0
    _, exponent = np.frexp(positive)
    return max(0, int((53 - exponent).max()))


def _scaled(values: np.ndarray, unit: int) -> tuple[int, ...]:
    """Each value times ``unit``, exactly (``unit`` a multiple of every value's denominator)."""
    out = []
    for value in np.asarray(values, dtype=np.float64).tolist():
        numerator, denominator = value.as_integer_ratio()
        scaled, rest = divmod(numerator * unit, denominator)
        assert not rest, (value, unit)  # (unit: a multiple of 2**_exact_bits(shares))
        out.append(scaled)
    return tuple(out)


def _rint(value: int, unit: int) -> int:
    """``value / unit`` rounded half to even (``np.rint``'s rule), exactly."""
    whole, rest = divmod(value, unit)
    if 2 * rest > unit or (2 * rest == unit and whole & 1):
        whole += 1
    return whole


@dataclass(frozen=True)
class _Segment:
    """The windows from one point to the next (from the last point: to the run's end).

    Window ``first + k`` covers tokens ``start + k * size`` up to the lesser of
    ``start + (k + 1) * size`` and ``end``. ``shares``: the point's shares, or (a linear ramp)
    the two points' (a row each; a window's are those at its midpoint). A source's target
    ``u`` tokens into the segment is exact, an integer over the layout's ``unit``:
    ``base + rate * u + curve * u**2`` (the integral of its share: constant, or linear in a
    ramp, where the midpoint's share times a window's tokens is that integral).
    """

    start: int
    end: int
    size: int
    first: int
    shares: np.ndarray
    base: tuple[int, ...]
    rate: tuple[int, ...]
    curve: tuple[int, ...] | None

    @property
    def windows(self) -> int:
        """How many windows it holds."""
        return -(-(self.end - self.start) // self.size)

    def span(self, k: int) -> tuple[int, int]:
        """Its window ``k``'s first token and tokens."""
        first = self.start + k * self.size
        return first, min(first + self.size, self.end) - first

    def exact(self, k: int) -> tuple[int, ...]:
        """Every source's exact target at the start of its window ``k`` (``windows``: the end)."""
        u = min(k * self.size, self.end - self.start)
        if self.curve is None:
            return tuple(b + r * u for b, r in zip(self.base, self.rate))
        return tuple(b + r * u + c * u * u for b, r, c in zip(self.base, self.rate, self.curve))

    def share_row(self, k: int) -> np.ndarray:
        """The shares of its window ``k``: the point's, or a ramp's at the window's midpoint."""
        if self.curve is None:
            return self.shares
        first, size = self.span(k)
        return _ramp_shares(self.shares, self.start, self.end, first, first + size)[0]

    def formula(self, k: int, unit: int) -> tuple[Fraction, ...]:
        """Every source's target, slope and curvature at its window ``k``, unit-free.

        Two segments with the same formula and window spans from there have the same targets.
        """
        u = k * self.size
        curve = self.curve or (0,) * len(self.rate)
        return tuple(
            Fraction(x, unit)
            for x in (*self.exact(k), *(r + 2 * c * u for r, c in zip(self.rate, curve)), *curve)
        )


def _ramp_shares(rows: np.ndarray, a: int, b: int, first: int, end: int) -> np.ndarray:
    """A ramp's window ``first .. end``: its shares at its midpoint, a row (``rows`` at a, b)."""
    t = np.asarray([[(float(first + end) / 2.0 - float(a)) / (float(b) - float(a))]])
    mixed = rows[0] * (1 - t) + rows[1] * t
    return mixed / mixed.sum(axis=1, keepdims=True)


#: ``same_until`` compares the targets of at most this many windows one by one (where a past
#: phase's shares changed by a rounding, e.g. weights 1:2 -> 0.1:0.2); past it, not the same.
SAME_UNTIL_SCAN = 100_000


@dataclass(frozen=True)
class ScheduleLayout:
    """A schedule resolved against its sources: any window's place and per-source targets.

    The run is a segment per point (``_Segment``; the last point's runs to the end), so a
    window's first token, tokens, shares and every source's cumulative target are computed on
    demand, in O(log points), whatever the run's length: no window is materialised. Targets
    are exact: the integral of each source's share over the tokens before the window, an
    integer over ``unit``, rounded once (half to even).
    """

    schedule: Schedule
    segments: tuple[_Segment, ...]
    unit: int
    tokens: tuple[int, ...]
    labels: tuple[str, ...]
    binding: str | None

    @property
    def windows(self) -> int:
        """The number of windows (epochs of the run)."""
        last = self.segments[-1]
        return last.first + last.windows

    @property
    def total_tokens(self) -> int:
        """Where the run ends."""
        return self.segments[-1].end

    @functools.cached_property
    def _firsts(self) -> tuple[int, ...]:
        return tuple(s.first for s in self.segments)

    def _locate(self, window: int) -> tuple[_Segment, int]:
        """The segment of window ``window`` and its place there (``windows``: past the last)."""
        seg = self.segments[bisect.bisect_right(self._firsts, window) - 1]
        return seg, window - seg.first

    def _check(self, window: int) -> None:
        if not 0 <= window < self.windows:
            raise ConfigError(
                f"epoch {window}: the schedule's run has {self.windows:,} windows (epochs 0 .. "
                f"{self.windows - 1:,}, {self.total_tokens:,} tokens); iterate epochs below "
                "ds.epochs, or raise Schedule.total_tokens / the sources' max_repetitions"
            )

    def span(self, window: int) -> tuple[int, int]:
        """Window ``window``'s first token and its tokens (ConfigError: not a window)."""
        self._check(window)
        seg, k = self._locate(window)
        return seg.span(k)

    def point_of(self, window: int) -> int:
        """The point (phase) whose options window ``window`` is read with (ConfigError: none).

        Segment ``i`` starts at point ``i`` in both kinds, so it is the segment's index.
        """
        self._check(window)
        return bisect.bisect_right(self._firsts, window) - 1

    def shares_of(self, window: int) -> np.ndarray:
        """Every source's share of window ``window`` (ConfigError: not a window)."""
        self._check(window)
        seg, k = self._locate(window)
        return seg.share_row(k)

    def _exact(self, window: int) -> tuple[int, ...]:
        seg, k = self._locate(window)
        return seg.exact(k)

    def targets(self, window: int) -> np.ndarray:
        """Every source's tokens in windows ``< window`` (``0 <= window <= windows``)."""
        if not 0 <= window <= self.windows:
            self._check(window)
        return np.asarray([_rint(x, self.unit) for x in self._exact(window)], dtype=np.int64)

    def window_targets(self, window: int) -> tuple[np.ndarray, np.ndarray]:
        """Every source's cumulative target at the window's start and end (ConfigError: past it)."""
        self._check(window)
        return self.targets(window), self.targets(window + 1)

    def epochs(
        self, units: list[SourceUnits], keys: tuple[int, ...], seed: int, window: int
    ) -> list[SourceEpoch]:
        """What window ``window`` takes of every source (``passes.stream_window``).

        ``units[s]``: source ``s``'s units (its side of a split); ``keys[s]``: its key.
        """
        begin, end = self.window_targets(window)
        return [
            stream_window(own, int(begin[s]), int(end[s]), seed, key)
            for s, (own, key) in enumerate(zip(units, keys))
        ]

    def _taken(self, seg: _Segment, ks: list[int]) -> np.ndarray:
        """Every source's tokens in the segment's windows ``ks``, a row each."""
        at = {k: [_rint(x, self.unit) for x in seg.exact(k)] for k in {*ks, *(k + 1 for k in ks)}}
        rows = [[b - a for a, b in zip(at[k], at[k + 1])] for k in ks]
        return np.asarray(rows, dtype=np.int64).reshape(len(ks), len(self.labels))

    def expected_documents(self, documents: list[int]) -> int:
        """About how many documents the largest window takes (``documents[s]`` per source).

        Every window of a segment of up to 64 windows; of a longer one its first and last 32
        (a segment's windows differ by a rounding, a ramp's most at its ends).
        """
        per_token = np.asarray(documents, dtype=np.float64) / np.maximum(
            np.asarray(self.tokens, dtype=np.float64), 1.0
        )
        taken = []
        for seg in self.segments:
            n = seg.windows
            ks = list(range(n)) if n <= 64 else [*range(32), *range(n - 32, n)]
            taken.append(self._taken(seg, ks))
        every = np.concatenate(taken) @ per_token
        return int(np.ceil(every.max())) if len(every) else 0

    def same_until(self, other: ScheduleLayout, window: int) -> bool:
        """Whether windows ``0 .. window`` are the same in both (so are their documents).

        Compared piece by piece (where neither layout starts a segment): the first and last
        window's place, then the targets: the same formula at the piece's start, else (shares
        that differ by a rounding) every window's rounded targets, up to ``SAME_UNTIL_SCAN``.
        """
        n = window + 1
        if window < 0 or self.windows < n or other.windows < n:
            return False
        cuts = {s.first for s in (*self.segments, *other.segments) if s.first < n}
        # batch options are constant within a segment: compare them where either one starts
        options = self.schedule.options_at, other.schedule.options_at
        if any(options[0](self.point_of(w)) != options[1](other.point_of(w)) for w in cuts):
            return False
        scan = [SAME_UNTIL_SCAN]
        return all(
            self._same_piece(other, a, b, scan) for a, b in itertools.pairwise(sorted({*cuts, n}))
        )

    def _same_piece(self, other: ScheduleLayout, first: int, after: int, scan: list[int]) -> bool:
        """``same_until`` on windows ``first .. after - 1``, each layout in one segment."""
        mine, k = self._locate(first)
        theirs, j = other._locate(first)
        last = after - 1 - first
        if mine.span(k) != theirs.span(j) or mine.span(k + last) != theirs.span(j + last):
            return False  # (both arithmetic: the first and last windows place every one)
        if mine.formula(k, self.unit) == theirs.formula(j, other.unit):
            return True
        if after - first + 1 > scan[0]:
            return False
        scan[0] -= after - first + 1
        return all(
            [_rint(x, self.unit) for x in mine.exact(k + i)]
            == [_rint(x, other.unit) for x in theirs.exact(j + i)]
            for i in range(after - first + 1)
        )

    def table(self, base: PlanOptions | None = None) -> ScheduleTable:
        """Per phase, each source's share, tokens and passes; where each source runs out.

        ``base``: the dataset's batch options, to give each phase's (when a point sets any;
        None: the options the points set).
        """
        totals = np.asarray(self.tokens, dtype=np.float64)
        phases, windows = [], []
        for seg in self.segments:
            at_start, at_end = (self.targets(w) for w in (seg.first, seg.first + seg.windows))
            given = at_end - at_start
            span = max(seg.end - seg.start, 1)
            rows = tuple(
                PhaseRow(
                    name=name,
                    share=float(given[s]) / span,
                    tokens=int(given[s]),
                    passes=float(at_end[s]) / totals[s],
                )
                for s, name in enumerate(self.labels)
            )
            phases.append((seg.start, seg.end, rows))
            windows.append((seg.first, seg.first + seg.windows))
        exhausted = {name: self._exhausted(s) for s, name in enumerate(self.labels)}
        return ScheduleTable(
            tuple(phases),
            self.total_tokens,
            self.windows,
            max(min(s.size, s.end - s.start) for s in self.segments),
            exhausted,
            self.binding,
            tuple(windows),
            self._phase_table(base),
        )

    def _phase_table(self, base: PlanOptions | None) -> tuple[dict[str, Any], ...]:
        """Each phase's batch options for ``table`` (none when no point sets any)."""
        schedule = self.schedule
        if not schedule.sets_options:
            return ()
        if base is None:
            return tuple(schedule.options_at(i) for i in range(len(schedule.points)))
        every = schedule.every_phase_options(base)
        return tuple({k: getattr(o, k) for k in PHASE_OPTIONS} for o in every)

    def _exhausted(self, s: int) -> int | None:
        """The token where source ``s``'s first pass ends (None: not in the run).

        The first window whose end target reaches the source's tokens (a bisection: targets
        never decrease), then the place inside it at the window's share.
        """
        need = self.tokens[s]

        def reached(window: int) -> bool:
            return _rint(self._exact(window)[s], self.unit) >= need

        if not reached(self.windows):
            return None
        lo, hi = 0, self.windows  # reached(hi); the answer is the first such window
        while lo < hi:
            mid = (lo + hi) // 2
            if reached(mid):
                hi = mid
            else:
                lo = mid + 1
        if lo == 0:
            return 0
        w = lo - 1  # the window in which the source's first pass ends
        start, size = self.span(w)
        had = int(self.targets(w)[s])
        inside = (need - had) / max(float(self.shares_of(w)[s]), 1e-300)
        return start + min(round(inside), size)


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


def resolve_schedule(
    schedule: Schedule, sources: tuple[Source, ...], tokens: list[int]
) -> ScheduleLayout:
    """Cut the run into a segment of windows per point and give each source its exact targets.

    ``tokens[s]``: what source ``s`` gives the mixture (its cache, or its side of a split).
    O(points x sources), whatever ``at_tokens``: no window is materialised.
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
    linear = schedule.kind == "linear" and len(ats) > 1
    ramps = [2 * (b - a) for a, b in itertools.pairwise(ats)] if linear else []
    # every target an integer over ``unit``: the shares' denominators, and a ramp's 2 x length
    bits = _exact_bits(shares_at)
    unit = (1 << bits) * math.lcm(*ramps)
    rates = [_scaled(row, unit) for row in shares_at]
    segments: list[_Segment] = []
    base, first = (0,) * len(labels), 0

    def add(a: int, b: int, size: int, shares: np.ndarray, rate: tuple[int, ...],
            curve: tuple[int, ...] | None) -> tuple[int, ...]:  # fmt: skip
        nonlocal first
        segments.append(_Segment(a, b, size, first, shares, base, rate, curve))
        first += segments[-1].windows
        return segments[-1].exact(segments[-1].windows)

    for i, (a, b) in enumerate(itertools.pairwise(ats)):
        if not linear:
            base = add(a, b, window, shares_at[i], rates[i], None)
            continue
        size = max(1, min(window, math.ceil((b - a) * LINEAR_WINDOW_SHARE)))
        # a share linear in u: the target's u**2 term is (next - this) / (2 (b - a)), exact
        curve = tuple((y - x) // (2 * (b - a)) for x, y in zip(rates[i], rates[i + 1]))
        base = add(a, b, size, shares_at[i : i + 2], rates[i], curve)
    # caps up to the last point, exactly
    over_exact = [Fraction(u, unit) - Fraction(float(c)) for u, c in zip(base, caps)]
    used = np.asarray([float(Fraction(u, unit)) for u in base], dtype=np.float64)
    over = np.asarray([float(x) for x in over_exact], dtype=np.float64)
    worst = int(np.argmax(over / np.maximum(caps, 1)))
    if over_exact[worst] > Fraction(1, 2):
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
    end = add(ats[-1], total, window, last, rates[-1], None)
    for s, source in enumerate(sources):
        reached = _rint(end[s], unit)
        if reached > math.floor(caps[s]) + 1:
            raise _over_cap(source, tokens[s], float(reached), total, "the run's end")
    return ScheduleLayout(schedule, tuple(segments), unit, tuple(tokens), labels, binding)


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
    recorded = [p for p in theirs.get("points") or [] if isinstance(p, dict)]
    old = {p.get("at_tokens"): p.get("weights") for p in recorded}
    new = {p["at_tokens"]: p["weights"] for p in ours["points"]}
    old_options = {p.get("at_tokens"): _set_options(p) for p in recorded}
    new_options = {p["at_tokens"]: _set_options(p) for p in ours["points"]}
    for at in sorted({*old, *new}, key=lambda x: (not isinstance(x, int), x)):
        if at not in new:
            lines.append(f"point at_tokens={at}: removed")
        elif at not in old:
            options = f" with batch options {new_options[at]}" if new_options[at] else ""
            lines.append(f"point at_tokens={at}: added {new[at]}{options}")
        else:
            if old[at] != new[at]:
                lines.append(f"point at_tokens={at}: weights {old[at]} -> {new[at]}")
            if old_options[at] != new_options[at]:
                lines.append(
                    f"point at_tokens={at}: batch options {old_options[at]} -> {new_options[at]}"
                )
    return lines


def _set_options(point: dict[str, Any]) -> dict[str, Any]:
    """The batch options a recorded point sets (``SchedulePoint.to_json``'s)."""
    return {k: point[k] for k in PHASE_OPTIONS if k in point}


def window_documents(lengths: np.ndarray, first: int, last: int, seed: int, key: int) -> np.ndarray:
    """The local ids between token positions ``first`` and ``last`` of a one-shard source's stream.

    The stream is pass 0, pass 1, ... of the source's documents, each pass in its own order;
    both positions are moved to the nearest document boundary (``passes.stream_window``).
    """
    return stream_window(SourceUnits.of(lengths), first, last, seed, key).documents()
