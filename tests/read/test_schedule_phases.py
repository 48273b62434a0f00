"""Length phases: schedule points that set their phase's batch options (seq_len, max_tokens,
mode, packing). Each phase's windows are planned and collated with its options, later points
inherit them, bad options are refused at construction naming the point, a resume across a
phase boundary at another world size is byte-identical, and a changed future phase's options
are accepted on resume while a changed past one is refused."""

from __future__ import annotations

import bisect
import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_dataset_mixture import three_caches
from test_schedule import _make as make_schedule_reader
from test_schedule import _sources
from torch.utils.data import DataLoader

from shardcache import ConfigError, PlanOptions, Schedule, ShardDataset, Source, StateError
from shardcache.read.selection.schedule import resolve_schedule, schedule_changes

WINDOW = 2_000
BOUNDARY = 5_000  # phase 1 starts here: windows 0-1 full, window 2 cut to 1,000 tokens
PAD_BUDGET = 256
LONG = {"mode": "pack", "seq_len": 64, "max_tokens": 128}  # phase 1: packed rows of 64


@pytest.fixture(scope="module")
def caches(tmp_path_factory, tokenizer_dir) -> dict[str, str]:
    """Three caches of one tokenizer (sequences of at most 64 tokens)."""
    return three_caches(tmp_path_factory.mktemp("phases"), tokenizer_dir)


def _schedule(late: dict | None = None, early: dict | None = None, **kwargs) -> Schedule:
    """Phase 0 padded (the dataset's options), phase 1 packed (``late``), phase 2 inherits."""
    late = LONG if late is None else late
    points = [
        {"at_tokens": 0, "weights": {"web": 0.7, "code": 0.3}, **(early or {})},
        {"at_tokens": BOUNDARY, "weights": {"web": 0.3, "code": 0.3, "math": 0.4}, **late},
        {"at_tokens": 8_000},  # weights and batch options of phase 1
    ]
    return Schedule(points, window_tokens=WINDOW, total_tokens=11_000, **kwargs)


def _make(caches, schedule=None, **kwargs):
    """test_schedule's maker with this module's schedule, budget and attention."""
    options = {"attention": "mask", **kwargs}
    return make_schedule_reader(caches, schedule or _schedule(), PAD_BUDGET, **options)


def _same(a, b) -> bool:
    """Two batches hold the same keys and equal values, byte for byte (``meta`` too)."""
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    return a == b


def test_a_point_s_batch_options_are_checked_and_inherited():
    base = PlanOptions(max_tokens=256)
    schedule = Schedule(
        [
            {"at_tokens": 0, "weights": {"a": 1}},
            {"at_tokens": 10, "seq_len": 64, "mode": "pack"},  # weights: the previous point's
            {"at_tokens": 20, "weights": {"a": 1, "b": 1}},
            {"at_tokens": 30, "mode": "pad", "max_tokens": 512},
            {"at_tokens": 40, "mode": "pack", "seq_len": 128.0, "packing": "concat"},
        ]
    )
    assert schedule.points[1].weights == {"a": 1.0}
    every = schedule.every_phase_options(base)
    got = [(o.mode, o.seq_len, o.max_tokens, o.packing) for o in every]
    assert got == [
        ("pad", None, 256, "best_fit"),
        ("pack", 64, 256, "best_fit"),
        ("pack", 64, 256, "best_fit"),  # inherited
        ("pad", None, 512, "best_fit"),  # pad ends the inherited seq_len
        ("pack", 128, 512, "concat"),
    ]
    assert every[0] is base  # the first phase sets nothing: the dataset's options
    assert schedule.options_at(2) == {"mode": "pack", "seq_len": 64}
    # the options are part of the schedule's JSON, and only when set
    again = Schedule.from_json(json.loads(json.dumps(schedule.to_json())))
    assert again == schedule
    assert schedule.to_json()["points"][0] == {"at_tokens": 0, "weights": {"a": 1.0}}
    assert schedule.to_json()["points"][4]["seq_len"] == 128
    # a padded dataset's pad_to_multiple_of applies to its pad phases only
    padded = PlanOptions(max_tokens=256, pad_to_multiple_of=8)
    assert schedule.phase_options(padded, 1).pad_to_multiple_of == 1
    assert schedule.phase_options(padded, 3).pad_to_multiple_of == 8
    # and a packed dataset's padded phase has no seq_len
    packed = PlanOptions(max_tokens=256, mode="pack", seq_len=32)
    assert schedule.phase_options(packed, 3).seq_len is None


@pytest.mark.parametrize(
    ("point", "message"),
    [
        ({"seq_len_": 64}, r"point #2: unknown key\(s\) \[.seq_len_.\].*max_tokens, mode, seq_len"),
        ({"seq_len": 0}, r"point #2 \(at_tokens=10\): seq_len: got 0"),
        ({"seq_len": True}, r"seq_len: got True"),
        ({"max_tokens": 2**40}, r"point #2 .*max_tokens: got 1099511627776"),
        ({"mode": "packed"}, r"mode: got 'packed'.*did you mean 'pack'"),
        ({"packing": "best"}, r"packing: got 'best'"),
        ({"mode": "pad", "seq_len": 64}, r"seq_len=64 with mode='pad'.*set mode='pack'"),
        ({"seq_len": 128, "max_tokens": 64}, r"seq_len=128 exceeds max_tokens=64"),
        ({"weights": {}}, r"point #2 .*weights=\{\}"),
    ],
)
def test_a_point_with_bad_batch_options_is_refused_naming_it(point, message):
    with pytest.raises(ConfigError, match=message):
        Schedule([{"at_tokens": 0, "weights": {"a": 1}}, {"at_tokens": 10, **point}])


@pytest.mark.parametrize(
    ("base", "point", "message"),
    [  # valid alone, not with what the phase inherits
        ({"max_tokens": 64}, {"mode": "pack", "seq_len": 128}, r"seq_len: 128 exceeds max_tok"),
        ({"max_tokens": 64}, {"seq_len": 32}, r"seq_len: got 32 with mode='pad'"),
        ({"max_tokens": 64}, {"mode": "pack"}, r"mode='pack' needs seq_len"),
        ({"max_tokens": 256, "mode": "pack", "seq_len": 128}, {"max_tokens": 64}, r"128 exce"),
    ],
)
def test_a_phase_s_options_invalid_over_the_inherited_ones_name_the_point(base, point, message):
    schedule = Schedule([{"at_tokens": 0, "weights": {"a": 1}}, {"at_tokens": 10, **point}])
    with pytest.raises(ConfigError, match=r"schedule point #2 \(at_tokens=10\)") as err:
        schedule.phase_options(PlanOptions(**base), 1)
    assert err.match(message)
    assert schedule.phase_options(PlanOptions(**base), 0) == PlanOptions(**base)


def test_a_linear_schedule_changes_options_at_points_only(caches):
    points = [
        {"at_tokens": 0, "weights": {"web": 1, "code": 0}},
        {"at_tokens": 4_000, "weights": {"web": 0, "code": 1}, **LONG},
        {"at_tokens": 6_000, "weights": {"web": 1, "code": 1}},
    ]
    schedule = Schedule(points, kind="linear", window_tokens=500, total_tokens=8_000)
    layout = resolve_schedule(schedule, tuple(_sources(caches)), [20_000, 20_000, 20_000])
    base = PlanOptions(max_tokens=PAD_BUDGET)
    for w in range(layout.windows):
        start, size = layout.span(w)
        options = schedule.phase_options(base, layout.point_of(w))
        # no window straddles a point: it is all before 4,000 (padded) or all after (packed)
        assert start + size <= 4_000 or start >= 4_000
        assert options.seq_len == (64 if start >= 4_000 else None), w


@settings(max_examples=60, deadline=None)
@given(
    gaps=st.lists(st.integers(1, 5_000), min_size=1, max_size=5),
    sets=st.lists(
        st.sampled_from([{}, {"mode": "pack", "seq_len": 32}, {"mode": "pad"}, {"max_tokens": 512}])
    ),
    kind=st.sampled_from(["phases", "linear"]),
    window=st.integers(7, 3_000),
)
def test_every_window_has_exactly_one_point_s_options(gaps, sets, kind, window):
    """Whatever the points and window size: a window lies between two points, and reads the
    options of the last point at or before its start (what a phase sets, then inherits)."""
    ats = [0, *np.cumsum(gaps).tolist()]
    points = [
        {"at_tokens": at, "weights": {"a": 1 + i % 2, "b": 1}, **(sets[i] if i < len(sets) else {})}
        for i, at in enumerate(ats)
    ]
    schedule = Schedule(points, kind=kind, window_tokens=window, total_tokens=ats[-1] + 999)
    sources = (
        Source("a", name="a", max_repetitions=1e9),
        Source("b", name="b", max_repetitions=1e9),
    )
    layout = resolve_schedule(schedule, sources, [10_000, 10_000])
    base = PlanOptions(max_tokens=256, mode="pack", seq_len=64)
    for w in range(layout.windows):
        start, size = layout.span(w)
        point = bisect.bisect_right(ats, start) - 1
        assert layout.point_of(w) == point
        assert point + 1 == len(ats) or start + size <= ats[point + 1]  # no straddling
        want = dict(base.to_json())
        for p in points[: point + 1]:
            if p.get("mode") == "pad":
                want["seq_len"] = None
            want.update({k: v for k, v in p.items() if k not in ("at_tokens", "weights")})
        got = schedule.phase_options(base, layout.point_of(w)).to_json()
        assert {k: got[k] for k in ("max_tokens", "mode", "seq_len")} == {
            k: want[k] for k in ("max_tokens", "mode", "seq_len")
        }


def test_each_phase_s_windows_are_planned_and_collated_with_its_options(caches):
    ds = _make(caches)()
    assert ds.options.mode == "pad"  # the dataset's own options: the first phase's
    table = ds.schedule
    assert [table.phase_of(e) for e in range(ds.epochs)] == [0, 0, 0, 1, 1, 2, 2]
    assert [o["seq_len"] for o in table.options] == [None, 64, 64]
    assert [o["max_tokens"] for o in table.options] == [PAD_BUDGET, 128, 128]
    shown = table.format()
    assert "  batches: max_tokens=128, mode=pack, seq_len=64, packing=best_fit" in shown
    assert "  batches: max_tokens=256, mode=pad\n" in shown
    for epoch in range(ds.epochs):
        ds.set_epoch(epoch)
        batches = list(ds)
        assert batches
        phase = table.phase_of(epoch)
        for batch in batches:
            rows, width = batch["input_ids"].shape
            if phase == 0:  # padded to the longest row, within the budget
                assert "cu_seqlens" not in batch["meta"]
                assert rows * width <= PAD_BUDGET
                assert batch["attention_mask"].dim() == 2
            else:  # packed rows of the phase's seq_len, within its max_tokens
                assert width == 64 and rows <= 128 // 64
                assert "cu_seqlens" in batch["meta"]
                assert batch["attention_mask"].dim() == 4  # attention="mask" in packed phases
        assert len(ds.plan(epoch)) == len(batches)


def test_a_phase_whose_options_cannot_hold_a_sequence_is_refused_at_construction(caches):
    too_short = _schedule({"mode": "pack", "seq_len": 16, "max_tokens": 128})
    with pytest.raises(ConfigError, match=r"point #2 \(at_tokens=5,000\).*seq_len"):
        _make(caches, too_short)()
    too_small = _schedule({"max_tokens": 16})  # pad mode: a batch below the longest sequence
    with pytest.raises(ConfigError, match=r"point #2 \(at_tokens=5,000\).*max_tokens"):
        _make(caches, too_small, attention=None)()
    with pytest.raises(ConfigError, match=r"attention: mode='pack' needs attention"):
        ShardDataset(_sources(caches), PAD_BUDGET, schedule=_schedule())  # phase 1 packs


def test_a_concat_phase_with_reserved_growth_needs_a_transform(caches):
    """``growth`` without a transform is refused under concat packing (concat would plan
    documents longer than they are): for a phase's concat as for the dataset's."""
    from shardcache import FIM

    concat = _schedule({"mode": "pack", "seq_len": 64, "max_tokens": 128, "packing": "concat"})
    with pytest.raises(ConfigError, match=r"point #2 \(at_tokens=5,000\), its phase's growth"):
        _make(caches, concat, growth=4)()
    _make(caches, concat)()  # no growth reserved: fine
    fim = FIM(0.5, 5, 6, 7)  # a transform that may lengthen: growth is its own, to fill
    assert _make(caches, concat, transform=fim)().options.growth == fim.max_growth


def test_plan_store_digests_and_counts_key_on_the_window_s_options(caches):
    ds = _make(caches)()
    planner = ds._planner
    assert planner.options_for(2) == ds.options
    assert planner.options_for(3).seq_len == 64
    digests = {planner.digest(e) for e in (3, 4)}
    assert len(digests) == 2
    # the same data and phase 0, other phase-1 options: only phase 1's digests differ
    other = _make(caches, _schedule({**LONG, "max_tokens": 192}))()._planner
    assert other.options_for(3).max_tokens == 192
    assert other.digest(3) != planner.digest(3)


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")
@pytest.mark.parametrize(("saved", "workers"), [(2, 0), (2, 2), (3, 2)])
def test_resume_across_a_length_phase_at_another_world_size_is_byte_identical(
    caches, saved, workers
):
    """Every rank of 4 reads ``steps`` batches of epoch ``saved``; 3 ranks (with ``workers``
    DataLoader workers) resume from rank 0's state, finish the epoch and read the next one (in
    phase 1): every batch equals the uninterrupted run's, byte for byte."""
    make = _make(caches)
    whole = make()

    def global_batches(epoch: int) -> list:
        whole.set_epoch(epoch)
        plan = whole.plan(epoch)
        return [whole.collate_batch(plan, j) for j in range(len(plan))]

    expected = {e: global_batches(e) for e in (saved, saved + 1)}
    steps = 2
    state = None
    for rank in range(4):
        ds = make(rank, 4)
        ds.set_epoch(saved)
        it = iter(ds)
        for i in range(steps):
            assert _same(next(it), expected[saved][rank + 4 * i])
        state = state or json.loads(json.dumps(ds.state_dict()))
    assert state["consumed"] == 4 * steps
    for rank in range(3):
        ds = make(rank, 3)
        ds.load_state_dict(state)
        rest = list(DataLoader(ds, batch_size=None, num_workers=workers))
        left = len(expected[saved]) - 4 * steps
        want = [expected[saved][4 * steps + rank + 3 * i] for i in range(left // 3)]
        assert len(rest) == len(want)
        assert all(_same(a, b) for a, b in zip(rest, want)), f"rank {rank}, epoch {saved}"
        ds.set_epoch(saved + 1)
        after = list(DataLoader(ds, batch_size=None, num_workers=workers))
        want = expected[saved + 1][rank::3][: len(expected[saved + 1]) // 3]
        assert len(after) == len(want)
        assert all(_same(a, b) for a, b in zip(after, want)), f"rank {rank}, next epoch"
        assert all(b["input_ids"].shape[1] == 64 for b in after)  # phase 1: packed rows


def test_a_future_phase_s_options_may_change_on_resume_but_not_the_current_one_s(caches):
    make = _make(caches)
    first = make()
    first.set_epoch(2)  # the last window of phase 0
    it = iter(first)
    next(it)
    state = json.loads(json.dumps(first.state_dict()))
    rest = list(it)
    assert state["mixture"]["schedule"]["points"][1]["seq_len"] == 64

    shorter = {**LONG, "seq_len": 32, "max_tokens": 96, "packing": "concat"}
    future = _make(caches, _schedule(shorter))()
    with pytest.warns(UserWarning, match=r"at_tokens=5000: batch options .*'seq_len': 32"):
        future.load_state_dict(state)
    assert all(_same(a, b) for a, b in zip(future, rest))
    future.set_epoch(3)
    assert {tuple(b["input_ids"].shape) for b in future} <= {(1, 32), (2, 32), (3, 32)}

    current = _make(caches, _schedule(early={"max_tokens": 192}))()
    with pytest.raises(StateError, match=r"at_tokens=0: batch options \{\} -> \{'max_tokens'"):
        current.load_state_dict(state)
    # the same change a phase later: accepted once the state is in phase 1's windows
    first.set_epoch(3)
    inside = json.loads(json.dumps(first.state_dict()))
    with pytest.raises(StateError, match="batch options"):
        _make(caches, _schedule(shorter))().load_state_dict(inside)


def test_schedule_changes_list_options_and_schedules_without_options_are_unchanged():
    plain = Schedule([{"at_tokens": 0, "weights": {"a": 1}}, {"at_tokens": 9, "weights": {"a": 2}}])
    assert plain.to_json()["points"][1] == {"at_tokens": 9, "weights": {"a": 2.0}}
    assert not plain.sets_options
    phased = Schedule([plain.points[0], {"at_tokens": 9, "weights": {"a": 2}, "seq_len": 8}])
    assert schedule_changes(plain.to_json(), phased.to_json()) == [
        "point at_tokens=9: batch options {} -> {'seq_len': 8}"
    ]
    added = Schedule([plain.points[0], {"at_tokens": 5, "mode": "pad"}, plain.points[1]])
    assert "point at_tokens=5: added {'a': 1.0} with batch options {'mode': 'pad'}" in (
        schedule_changes(plain.to_json(), added.to_json())
    )


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")
def test_rewind_recomputes_the_steps_of_both_phases_from_the_run_record(caches, tmp_path):
    from shardcache.read.rewind import Rewinder, write_run_record

    make = _make(caches)
    log = {}
    for rank in range(2):
        with make(rank, 2) as ds:
            if rank == 0:
                write_run_record(str(tmp_path), ds, grad_accum=1)
            step = 0
            for epoch in range(5):  # phase 0, then the windows of phase 1
                ds.set_epoch(epoch)
                for batch in DataLoader(ds, batch_size=None, num_workers=2):
                    log[(step, rank)] = batch
                    packed = "cu_seqlens" in batch["meta"]
                    assert packed == (epoch >= 3), epoch  # each phase's batches
                    step += 1
    with Rewinder(str(tmp_path)) as rewinder:
        for (step, rank), want in log.items():
            (got,) = rewinder.step(step, rank=rank)
            assert _same(got.batch, want), (step, rank)
