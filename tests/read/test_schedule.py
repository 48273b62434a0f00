"""Mixture schedules: phase shares, per-source epochs over the run, exact resume, and changes
of the schedule on resume (future: accepted; past: refused)."""

from __future__ import annotations

import collections
import itertools
import json
import math
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_dataset_mixture import _resume_stream, _segments, three_caches

from shardcache import ConfigError, Schedule, ShardDataset, Source, StateError, open_cache
from shardcache.read.selection.mixture import MixtureIndex
from shardcache.read.selection.mixture_table import normalised_shares
from shardcache.read.selection.schedule import resolve_schedule, window_documents

WINDOW = 2_000
BOUNDARY = 5_000  # the second phase starts here: windows 0-1 full, window 2 cut to 1,000 tokens


@pytest.fixture(scope="module")
def caches(tmp_path_factory, tokenizer_dir) -> dict[str, str]:
    """Three caches of one tokenizer: web (large), code, math (small)."""
    return three_caches(tmp_path_factory.mktemp("schedule"), tokenizer_dir)


def _sources(caches) -> list[Source]:
    return [
        Source(caches["web"], name="web", max_repetitions=4),
        Source(caches["code"], name="code", max_repetitions=8),
        Source(caches["math"], name="math", max_repetitions=16),
    ]


def _schedule(late: dict[str, float] | None = None, **kwargs) -> Schedule:
    late = late or {"web": 0.3, "code": 0.3, "math": 0.4}
    points = [
        {"at_tokens": 0, "weights": {"web": 0.7, "code": 0.3}},
        {"at_tokens": BOUNDARY, "weights": late},
    ]
    return Schedule(points, window_tokens=WINDOW, total_tokens=11_000, **kwargs)


def _uses(ds: ShardDataset, epoch: int) -> list[tuple[int, int, int]]:
    """(source, local id, tokens) of every row of an epoch on one rank (pad mode: whole rows)."""
    ds.set_epoch(epoch)
    return [seg for batch in ds for seg in _segments(batch)]


def test_windows_read_each_source_s_passes_without_reuse():
    lengths = np.random.default_rng(0).integers(1, 50, size=37)
    total = int(lengths.sum())
    cuts = [0, 100, 101, 700, 700, total - 3, total + 40, 3 * total + 7]
    taken = [window_documents(lengths, a, b, seed=5, key=9) for a, b in itertools.pairwise(cuts)]
    stream = np.concatenate(taken)
    for p in range(len(stream) // 37):  # every complete pass holds every document once
        assert sorted(stream[37 * p : 37 * (p + 1)].tolist()) == list(range(37))
    got = int(lengths[stream].sum())
    assert abs(got - cuts[-1]) <= lengths.max()  # within one longest document of the target
    again = window_documents(lengths, 700, total - 3, seed=5, key=9)
    assert again.tolist() == taken[4].tolist()  # a window alone: the same documents


def test_phase_targets_are_exact_and_caps_bound_the_whole_run(caches):
    sources = tuple(_sources(caches))
    tokens = [5_000, 2_000, 700]
    layout = resolve_schedule(_schedule(), sources, tokens)
    assert [layout.span(w)[0] for w in range(layout.windows)] == [0, 2_000, 4_000, 5_000,
                                                                  7_000, 9_000]  # fmt: skip
    phase1 = layout.targets(3)
    assert phase1.tolist() == [3_500, 1_500, 0]
    assert (layout.targets(layout.windows) - phase1).tolist() == [1_800, 1_800, 2_400]
    table = layout.table()
    assert [round(r.share, 4) for r in table.phases[1][2]] == [0.3, 0.3, 0.4]
    assert table.exhausted["math"] is not None
    with pytest.raises(ConfigError, match=r"source 'web'.*1,500 over"):
        resolve_schedule(_schedule(), sources, [500, 2_000, 700])  # 3,500 > 4 x 500
    with pytest.raises(ConfigError, match=r"source 'math'.*over"):
        resolve_schedule(_schedule(), sources, [5_000, 2_000, 140])  # 2,400 > 16 x 140
    capped = (sources[0], sources[1], Source(sources[2].path, name="math", max_repetitions=4))
    end = resolve_schedule(Schedule(_schedule().points, window_tokens=WINDOW), capped, tokens)
    assert end.binding == "math"  # 4 passes of 700 at 0.4 after 5,000: ends at 12,000
    assert end.total_tokens == 12_000


def test_delivered_shares_per_phase_and_no_document_reused_before_its_source_is_used_up(caches):
    ds = ShardDataset(_sources(caches), 256, seed=1, schedule=_schedule())
    assert ds.epochs == 6
    opened = [open_cache(c) for c in (caches["web"], caches["code"], caches["math"])]
    longest = max(int(np.max(c.lengths)) for c in opened)
    uses = [collections.Counter() for _ in opened]
    phase_tokens = [collections.Counter(), collections.Counter()]
    for epoch in range(ds.epochs):
        for s, i, n in _uses(ds, epoch):
            phase_tokens[epoch >= 3][s] += n
            uses[s][i] += 1
        for s, counter in enumerate(uses):  # at every window's end: passes are whole
            seen = [counter.get(i, 0) for i in range(opened[s].num_sequences)]
            assert max(seen) - min(seen) <= 1, f"source {s} after epoch {epoch}"
    targets = [(3_500, 1_500, 0), (1_800, 1_800, 2_400)]
    for phase, want in enumerate(targets):
        for s in range(3):
            assert abs(phase_tokens[phase][s] - want[s]) <= longest, (phase, s)
    stats = ds.stats()["schedule"]
    assert stats["epochs"] == list(range(6))
    totals = [phase_tokens[0][s] + phase_tokens[1][s] for s in range(3)]
    assert list(stats["delivered_tokens"].values()) == totals
    want = {"web": 5_300 / 11_000, "code": 3_300 / 11_000, "math": 2_400 / 11_000}
    for name, share in stats["scheduled_shares"].items():
        assert abs(share - want[name]) <= 0.02
        assert abs(stats["delivered_shares"][name] - share) <= 0.03
    with pytest.raises(ConfigError, match="6 windows"):
        ds.set_epoch(6)


def _make(caches, schedule=None, budget=64, **kwargs):
    """A maker of the scheduled mixture's reader at ``(rank, world)``: seed 2, 4 streams."""

    def make(rank: int = 0, world: int = 1) -> ShardDataset:
        return ShardDataset(
            _sources(caches),
            budget,
            seed=2,
            rank=rank,
            world_size=world,
            streams=4,
            schedule=schedule or _schedule(),
            **kwargs,
        )

    return make


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")
@pytest.mark.parametrize("how", ["loop", "dataloader", "stateful"])
def test_resume_at_another_world_size_and_workers_across_a_phase_boundary(caches, how):
    base = _make(caches)
    rng = np.random.default_rng(len(how))
    workers = 0 if how == "loop" else 2
    for epoch in (2, 3):  # the last window of the first phase, the first of the second

        def make(rank, world, epoch=epoch):
            ds = base(rank, world)
            ds.set_epoch(epoch)
            return ds

        whole = make(0, 1)
        index = MixtureIndex.of([s.documents for s in whole.mixture.sources])
        plan = whole.plan()
        steps = int(rng.integers(1, make(0, 4).batches_per_rank()))
        head, rest = _resume_stream(make, 4, 3, workers, 0, steps, how)
        tail = (len(plan) - 4 * steps) % 3
        expected = []
        for b in range(len(plan) - tail):
            source, local = index.locate(plan.batch(b))
            expected.append(tuple(zip(source.tolist(), local.tolist())))
        assert sorted(head + rest) == sorted(expected), f"epoch {epoch} after {steps} steps"


def _keys(ds) -> list:
    return [tuple(seg[:2] for seg in _segments(b)) for b in ds]


def test_a_future_phase_edited_on_resume_keeps_the_past_stream_and_the_past_is_refused(caches):
    make = _make(caches)
    first = make(0, 1)
    first.set_epoch(2)
    it = iter(first)
    head = [tuple(seg[:2] for seg in _segments(next(it))) for _ in range(3)]
    state = json.loads(json.dumps(first.state_dict()))
    rest = [tuple(seg[:2] for seg in _segments(b)) for b in it]
    first.set_epoch(3)
    old_next = _keys(first)

    edited = _make(caches, _schedule({"web": 0.1, "code": 0.1, "math": 0.8}))(0, 1)
    with pytest.warns(UserWarning, match=r"schedule changed after the state's epoch 2"):
        edited.load_state_dict(state)
    assert _keys(edited) == rest  # the window being read is the same, byte for byte
    edited.set_epoch(3)
    assert _keys(edited) != old_next  # the edited phase applies from its first window
    assert head  # (the head was read before the state)

    moved = Schedule(
        [
            {"at_tokens": 0, "weights": {"web": 0.7, "code": 0.3}},
            {"at_tokens": 4_500, "weights": {"web": 0.3, "code": 0.3, "math": 0.4}},
        ],
        window_tokens=WINDOW,
        total_tokens=11_000,
    )  # the boundary moves into window 2, which the state is reading
    past = _make(caches, moved)(0, 1)
    with pytest.raises(StateError, match=r"at_tokens=4500: added"):
        past.load_state_dict(state)
    remixed = _make(caches, moved, remix=True)(0, 1)
    with pytest.warns(UserWarning, match="remix=True"):
        remixed.load_state_dict(state)
    unscheduled = ShardDataset(_sources(caches), 64, seed=2, streams=4)
    with pytest.raises(StateError, match="schedule"):
        unscheduled.load_state_dict(state)


def test_schedule_refusals(caches):
    with pytest.raises(ConfigError, match="start at at_tokens=0"):
        Schedule([{"at_tokens": 5, "weights": {"web": 1}}])
    with pytest.raises(ConfigError, match="increase strictly"):
        Schedule([{"at_tokens": 0, "weights": {"web": 1}}, {"at_tokens": 0, "weights": {"a": 1}}])
    with pytest.raises(ConfigError, match=r"\['nope'\]"):
        ShardDataset(_sources(caches), 256, schedule=[{"at_tokens": 0, "weights": {"nope": 1}}])
    with pytest.raises(ConfigError, match="window_tokens"):
        ShardDataset(_sources(caches), 256, schedule=_schedule(), tokens_per_epoch=100)
    with pytest.raises(ConfigError, match="one cache has no weights"):
        ShardDataset(caches["web"], 256, schedule=_schedule())


def test_a_linear_schedule_gives_every_window_of_a_ramp_its_share_within_one_percent():
    rng = np.random.default_rng(3)
    lengths = [rng.integers(1, 40, size=n) for n in (40_000, 30_000)]  # ~800k and ~600k tokens
    tokens = [int(x.sum()) for x in lengths]
    sources = (Source("a", name="a", max_repetitions=3), Source("b", name="b", max_repetitions=3))
    ramp = 1_000_000
    schedule = Schedule(
        [{"at_tokens": 0, "weights": {"a": 1.0}}, {"at_tokens": ramp, "weights": {"b": 1.0}}],
        kind="linear",
        window_tokens=50_000,
        total_tokens=ramp + 100_000,
    )
    layout = resolve_schedule(schedule, sources, tokens)
    spans = [layout.span(w) for w in range(layout.windows)]
    assert max(size for start, size in spans if start < ramp) <= ramp // 100  # 1% of the ramp
    assert [size for start, size in spans if start >= ramp] == [50_000, 50_000]
    for w in range(layout.windows):
        begin, end = layout.window_targets(w)
        got = [
            int(x[window_documents(x, int(begin[s]), int(end[s]), 0, s)].sum())
            for s, x in enumerate(lengths)
        ]
        a, b = spans[w][0], spans[w][0] + spans[w][1]
        # the exact share of "b": the mean of the ramp over the window (1 after it)
        want_b = (min(max((a + b) / 2, 0), ramp) / ramp) if b <= ramp else 1.0
        assert abs(got[1] / sum(got) - want_b) <= 0.01, f"window {w} [{a}, {b})"


def test_a_scheduled_mixture_of_a_split_reads_only_that_side(caches):
    from shardcache import Split

    splits = Split(validation=0.2)
    ds = ShardDataset(
        _sources(caches), 256, seed=4, schedule=_schedule(), split="train", splits=splits
    )
    held = ShardDataset(_sources(caches), 256, split="validation", splits=splits, eval=True)
    valid = {seg[:2] for b in held for seg in _segments(b)}
    read = {seg[:2] for e in range(ds.epochs) for seg in _uses(ds, e)}
    assert valid and read and not read & valid


def test_a_run_stopped_at_a_phase_boundary_resumes_into_the_next_phase(caches):
    make = _make(caches)
    states = []
    for rank in range(4):  # every rank reads the whole last window of the first phase
        ds = make(rank, 4)
        ds.set_epoch(2)
        assert len(list(ds)) == ds.batches_per_rank()
        states.append(json.loads(json.dumps(ds.state_dict())))
    uninterrupted = []
    for rank in range(3):
        ds = make(rank, 3)
        ds.set_epoch(3)
        uninterrupted.append(_keys(ds))
    for rank in range(3):
        ds = make(rank, 3)
        ds.load_state_dict(states[0])
        # the window is spent but for what evening out 4 ranks left (fewer than 4 batches):
        # read at 3 ranks when it makes a round (split_epoch from the loaded position)
        left = len(ds.plan()) - states[0]["consumed"]
        assert 0 <= left < 4 and len(_keys(ds)) == left // 3
        ds.set_epoch(3)
        assert _keys(ds) == uninterrupted[rank]


def test_a_window_across_a_pass_numbers_each_copy_of_a_document_apart():
    """A window holding the end of a source's pass and the start of the next may hold a
    document twice, in any order: each copy has its own use (the transform's key), every
    (document, use) once, with the global plan (streams count copies in their own way)."""
    from shardcache.read.selection.mixture import document_uses
    from shardcache.read.selection.schedule import window_documents

    index = MixtureIndex.of([4])
    assert document_uses(np.array([3, 3, 1, 2, 0]), index, whole_passes=False).tolist() == [
        0, 1, 0, 0, 0
    ]  # fmt: skip
    assert document_uses(np.array([3, 1, 1]), index, whole_passes=False).tolist() == [0, 0, 1]
    lengths = np.arange(1, 9, dtype=np.int64)
    total = int(lengths.sum())
    crossing = 0
    for first in range(0, 3 * total, 5):
        docs = window_documents(lengths, first, first + total // 2 + 7, seed=1, key=3)
        uses = document_uses(docs, MixtureIndex.of([8]), whole_passes=False)
        if uses is None:
            assert len(set(docs.tolist())) == len(docs)
            continue
        crossing += 1
        pairs = list(zip(docs.tolist(), uses.tolist()))
        assert len(set(pairs)) == len(pairs)
    assert crossing > 0


def test_a_run_of_one_token_windows_is_cut_on_demand():
    """``window_tokens=1`` over 200,000 tokens: 200,000 windows (epochs), none cut before it
    is asked for."""
    sources = (Source("a", name="a"),)
    points = [{"at_tokens": 0, "weights": {"a": 1.0}}]
    layout = resolve_schedule(Schedule(points, window_tokens=1), sources, [200_000])
    assert layout.windows == 200_000 and len(layout.segments) == 1
    assert [t.tolist() for t in layout.window_targets(123_456)] == [[123_456], [123_457]]
    with pytest.raises(ConfigError, match=r"epoch 200000: the schedule's run has 200,000 windows"):
        layout.window_targets(200_000)


def _far_schedule(at: int) -> Schedule:
    """A phase of 0.75 / 0.25 up to ``at``, then 0.5 / 0.5 for 3,000 tokens (shares exact in
    binary, so every target is an integer)."""
    points = [
        {"at_tokens": 0, "weights": {"web": 0.75, "code": 0.25}},
        {"at_tokens": at, "weights": {"web": 0.5, "math": 0.5}},
    ]
    return Schedule(points, window_tokens=2_000, total_tokens=at + 3_000)


@pytest.mark.parametrize("at", [10**14, 10**18, 2**62])
def test_a_point_anywhere_up_to_2_62_tokens_resolves_and_any_window_is_answered(at):
    """Windows are computed on demand: a point at 1e14 .. 2**62 tokens (up to 2.3e15 windows
    of 2,000 tokens) resolves, and a window's targets and documents come without cutting the
    windows before it."""
    rng = np.random.default_rng(7)
    lengths = [rng.integers(1, 60, size=n) for n in (170, 60, 25)]
    tokens = [int(x.sum()) for x in lengths]
    sources = tuple(Source(n, name=n, max_repetitions=1e18) for n in ("web", "code", "math"))
    layout = resolve_schedule(_far_schedule(at), sources, tokens)
    phase1 = -(-at // 2_000)
    assert layout.windows == phase1 + 2
    last = phase1 - 1  # the last window of the first phase
    start = 2_000 * last
    begin, end = layout.window_targets(last)
    assert begin.tolist() == [3 * start // 4, start // 4, 0]
    assert end.tolist() == [3 * at // 4, at // 4, 0]
    begin, end = layout.window_targets(layout.windows - 1)  # the run's last 1,000 tokens
    assert (end - begin).tolist() == [500, 0, 500]
    assert end.tolist() == [3 * at // 4 + 1_500, at // 4, 1_500]
    for s, x in enumerate(lengths):  # a late window's documents: its targets, within one
        begin, end = layout.window_targets(last)
        got = int(x[window_documents(x, int(begin[s]), int(end[s]), 3, s)].sum())
        assert abs(got - int(end[s] - begin[s])) <= int(x.max())
    table = layout.table()
    assert table.windows == phase1 + 2 and table.total_tokens == at + 3_000
    assert table.phase_windows == ((0, phase1), (phase1, phase1 + 2))
    assert [r.tokens for r in table.phases[0][2]] == [3 * at // 4, at // 4, 0]
    assert [r.tokens for r in table.phases[1][2]] == [1_500, 0, 1_500]
    # web's first pass ends inside window w = ceil(tokens / 1,500) - 1, at its share's pace
    w = -(-tokens[0] // 1_500) - 1
    assert table.exhausted["web"] == 2_000 * w + round((tokens[0] - 1_500 * w) / 0.75)


def test_a_cap_broken_by_a_far_point_names_the_source_and_the_point():
    sources = tuple(Source(n, name=n, max_repetitions=4) for n in ("web", "code", "math"))
    with pytest.raises(ConfigError, match=r"source 'web' .* by token 1,000,000,000,000,000,000 "
                       r"\(its last point\).*max_repetitions=4 bounds"):  # fmt: skip
        resolve_schedule(_far_schedule(10**18), sources, [5_000, 2_000, 700])


@st.composite
def _runs(draw) -> tuple[Schedule, list[int], int, float]:
    """A schedule of 1-4 points over 1-3 sources, the sources' tokens, an edit's place and
    weight (a point added after the last, or a past point's weights rescaled by a rounding)."""
    k = draw(st.integers(1, 3))
    gaps = draw(st.lists(st.integers(1, 3_000), max_size=3))
    ats = [0, *itertools.accumulate(gaps)]
    weight = st.floats(0, 10, allow_nan=False, allow_subnormal=False)
    points = []
    for at in ats:
        w = draw(st.lists(weight, min_size=k, max_size=k).filter(lambda w: max(w) > 0))
        points.append({"at_tokens": at, "weights": {f"s{i}": x for i, x in enumerate(w)}})
    schedule = Schedule(
        points,
        kind=draw(st.sampled_from(["phases", "linear"])),
        window_tokens=draw(st.integers(10, 2_000)),
        total_tokens=ats[-1] + draw(st.integers(1, 3_000)),
    )
    tokens = draw(st.lists(st.integers(1, 20_000), min_size=k, max_size=k))
    return schedule, tokens, draw(st.integers(1, 2_999)), draw(st.floats(0.1, 10))


def _materialised(schedule: Schedule, labels: list[str]) -> dict:
    """The windows cut one by one as before, and every target from first principles: the
    exact integral of the source's share (a phase's, or linear between points) up to there."""
    ats = [p.at_tokens for p in schedule.points]
    window, total = schedule.window_tokens, schedule.total_tokens
    linear = schedule.kind == "linear"
    spans = []
    for i, (a, b) in enumerate(zip(ats, [*ats[1:], total])):
        size = window
        if linear and i < len(ats) - 1:
            size = max(1, min(window, math.ceil((b - a) * 0.01)))
        spans += [(x, min(x + size, b) - x) for x in range(a, b, size)]
    rows = [
        [Fraction(f) for f in normalised_shares([p.weights.get(x, 0.0) for x in labels])]
        for p in schedule.points
    ]

    def integral(x: int) -> list[Fraction]:
        got = [Fraction(0)] * len(labels)
        for i, a in enumerate(ats):
            b = ats[i + 1] if i + 1 < len(ats) else total
            u = min(x, b) - a
            if u <= 0:
                break
            for s in range(len(labels)):
                got[s] += rows[i][s] * u
                if linear and i + 1 < len(ats):
                    got[s] += (rows[i + 1][s] - rows[i][s]) * u * u / (2 * (b - a))
        return got

    starts = [start for start, _ in spans] + [total]
    return {"spans": spans, "targets": [[round(v) for v in integral(x)] for x in starts]}


def _shares(schedule: Schedule, labels: list[str], start: int, size: int) -> np.ndarray:
    """The shares a window should have: its phase's, or interpolated at its midpoint."""
    ats = [p.at_tokens for p in schedule.points]
    rows = [np.asarray([p.weights.get(x, 0.0) for x in labels]) for p in schedule.points]
    rows = [r / r.sum() for r in rows]
    i = int(np.searchsorted(ats, start, side="right")) - 1
    if schedule.kind == "phases" or i == len(ats) - 1:
        return rows[i]
    t = (start + size / 2 - ats[i]) / (ats[i + 1] - ats[i])
    mixed = rows[i] * (1 - t) + rows[i + 1] * t
    return mixed / mixed.sum()


@settings(max_examples=80, deadline=None)
@given(_runs())
def test_windows_on_demand_are_the_windows_cut_one_by_one(run):
    """Every window's place, shares and exact targets, the table, the largest window's
    documents and ``same_until`` under an edit, against the run cut window by window and
    targets integrated exactly."""
    schedule, tokens, after, rescale = run
    labels = [f"s{i}" for i in range(len(tokens))]
    sources = tuple(Source(x, name=x, max_repetitions=1e9) for x in labels)
    layout = resolve_schedule(schedule, sources, tokens)
    ref = _materialised(schedule, labels)
    assert [layout.span(w) for w in range(layout.windows)] == ref["spans"]
    for w, (start, size) in enumerate(ref["spans"]):
        want = _shares(schedule, labels, start, size)
        assert np.allclose(layout.shares_of(w), want, rtol=1e-9, atol=1e-12)
    targets = [layout.targets(w).tolist() for w in range(layout.windows + 1)]
    assert targets == ref["targets"]
    cum = np.asarray(targets, dtype=np.int64)
    table = layout.table()
    for (first, after_last), (_, _, rows) in zip(table.phase_windows, table.phases):
        assert [r.tokens for r in rows] == (cum[after_last] - cum[first]).tolist()
    for s, x in enumerate(labels):  # where the first pass ends: in the first window reaching it
        w = int(np.searchsorted(cum[:, s], tokens[s], side="left"))
        at = table.exhausted[x]
        assert (at is None) == (w > layout.windows)
        if at is not None:
            start, size = ref["spans"][w - 1]
            assert start <= at <= start + size
    documents = [max(1, t // (10 * (s + 1))) for s, t in enumerate(tokens)]  # (s: shorter)
    per_token = np.asarray(documents) / np.asarray(tokens)
    largest = int(np.ceil((np.diff(cum, axis=0) @ per_token).max()))
    got = layout.expected_documents(documents)
    if max(seg.windows for seg in layout.segments) <= 64:
        assert got == largest
    else:  # (the first and last 32 windows of each segment: within a token a source)
        assert largest - 1 <= got <= largest

    # an edit: a point added after the last (the past unchanged), or a past point's weights
    # all scaled (the same shares up to a rounding: the same windows while targets agree)
    points = [p.to_json() for p in schedule.points]
    if rescale < 5:
        points.append({"at_tokens": points[-1]["at_tokens"] + after, "weights": {labels[0]: 1.0}})
    else:
        points[0]["weights"] = {x: w * rescale for x, w in points[0]["weights"].items()}
    total = max(schedule.total_tokens, points[-1]["at_tokens"] + 1)
    edited_schedule = Schedule(points, schedule.kind, schedule.window_tokens, total)
    edited = resolve_schedule(edited_schedule, sources, tokens)
    theirs = _materialised(edited_schedule, labels)
    for w in range(layout.windows):
        same = (
            w < edited.windows
            and ref["spans"][: w + 1] == theirs["spans"][: w + 1]
            and ref["targets"][: w + 2] == theirs["targets"][: w + 2]
        )
        assert layout.same_until(edited, w) == same, w
        assert edited.same_until(layout, w) == same, w


def test_a_dataset_reads_a_window_past_1e17_tokens_and_resumes_there(caches):
    """A point at 10**17 tokens: 5e13 windows of 2,000, the last of the first phase read at
    its shares, and a state taken in it resumed at another world size."""
    sources = [Source(caches[x], name=x, max_repetitions=1e14) for x in ("web", "code", "math")]
    opened = [open_cache(caches[x]) for x in ("web", "code", "math")]
    longest = max(int(np.max(c.lengths)) for c in opened)

    def make(rank: int, world: int) -> ShardDataset:
        return ShardDataset(sources, 64, seed=3, schedule=_far_schedule(10**17), rank=rank,
                            world_size=world, streams=2)  # fmt: skip

    ds = make(0, 1)
    assert ds.epochs == 5 * 10**13 + 2
    epoch = ds.epochs - 3  # tokens 1e17 - 2,000 .. 1e17: 0.75 / 0.25 / 0
    read = collections.Counter()
    for s, _, n in _uses(ds, epoch):
        read[s] += n
    assert abs(read[0] - 1_500) <= longest and abs(read[1] - 500) <= longest and not read[2]
    whole = [tuple(seg[:2] for seg in _segments(b)) for b in ds]
    it = iter(ds)
    next(it)
    state = json.loads(json.dumps(ds.state_dict()))
    assert state["epoch"] == epoch
    # (its run record starts at epoch 0: a plain resume never counts the windows before this
    # one, reached by set_epoch; only a skip or a record of a reshaped run asks for the step)
    rest = []
    for rank in range(2):
        other = make(rank, 2)
        other.load_state_dict(state)
        rest += _keys(other)
    assert sorted(rest) == sorted(whole[1 : 1 + len(rest)]) and rest
