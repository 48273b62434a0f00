"""The reader state: a global cursor with what it is a cursor of, taken and checked on load.

A state is JSON: the version, the data's digest, seed and plan options, the epoch and the
global batches consumed, the world size it was taken at, and the selection's own records (a
mixture, a split). Loading refuses a state of other data, another split or other plan options,
and a cursor that cannot be a position in this plan.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from shardcache.errors import StateError
from shardcache.read.plan.epoch_plan import DEFAULT_SHUFFLE_BLOCK, PlanOptions
from shardcache.read.position import dataset_state_of_loader
from shardcache.read.selection.selection import Selection

STATE_VERSION = 1


def take_state(
    selection: Selection,
    seed: int,
    options: PlanOptions,
    epoch: int,
    consumed: int,
    world_size: int,
    worker: dict[str, int] | None,
) -> dict[str, Any]:
    """The state of a reader at global cursor ``consumed`` of ``epoch``."""
    state: dict[str, Any] = {
        "version": STATE_VERSION,
        "cache_digest": selection.cache_digest,
        "seed": seed,
        "plan": options.to_json(),
        "epoch": epoch,
        "consumed": consumed,
        "world_size": world_size,
        **selection.state(),
    }
    split_state = selection.split_state()
    if split_state is not None:
        state["split"] = split_state
    if worker is not None:
        state["worker"] = dict(worker)
    return state


def check_data(state: Any, selection: Selection, remix: bool) -> tuple[dict[str, Any], bool]:
    """The dataset state in ``state`` (a loader's too) and whether it is another mixture's.

    Raises StateError for a state of another version, cache, mixture (without ``remix``) or
    split.
    """
    if isinstance(state, dict) and "version" not in state:
        converted = dataset_state_of_loader(state)
        if converted is not None:
            state = converted
    if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
        raise StateError(
            f"reader state: expected a dict with version {STATE_VERSION}, got "
            f"{type(state).__name__} with version "
            f"{state.get('version') if isinstance(state, dict) else None!r}; pass what "
            "ShardDataset.state_dict() returned"
        )
    remixed = selection.check_state(state, remix)
    if not remixed and state.get("cache_digest") != selection.cache_digest:
        raise StateError(
            f"reader state: it was taken on a cache with digest {state.get('cache_digest')!r}"
            f" but {selection.path!r} has digest {selection.cache_digest!r}; the data differ, so "
            "the position means nothing here. Resume on the cache the state came from, or start "
            "this cache from epoch 0 without loading the state"
        )
    ours_split = selection.split_state()
    if state.get("split") != ours_split:
        raise StateError(
            f"reader state: it was taken on split {state.get('split')!r} but this dataset "
            f"reads split {ours_split!r}; another split plans other documents. Construct "
            "the ShardDataset with the split= and splits= of the state"
        )
    return state, remixed


def check_plan(
    state: dict[str, Any], seed: int, options: PlanOptions, auto_streams: bool
) -> PlanOptions:
    """The options to read the state with: ``options``, with the state's streams if automatic.

    Raises StateError when the seed or another plan option differs.
    """
    # a state of a version without streams was read with the global plan (streams=0)
    theirs_plan = {"streams": 0, "shuffle_block": DEFAULT_SHUFFLE_BLOCK, "growth": 0}
    theirs_plan.update(dict(state.get("plan") or {}))
    if auto_streams and theirs_plan["streams"] != options.streams:
        streams = theirs_plan["streams"]
        if isinstance(streams, int) and not isinstance(streams, bool) and streams >= 0:
            # streams=None means "as the run started": the state says how it started
            options = dataclasses.replace(options, streams=streams)
    ours = {"seed": seed, **options.to_json()}
    theirs = {"seed": state.get("seed"), **theirs_plan}
    changed = sorted(k for k in set(ours) | set(theirs) if ours.get(k) != theirs.get(k))
    if changed:
        diff = ", ".join(f"{k}: {theirs.get(k)!r} -> {ours.get(k)!r}" for k in changed)
        raise StateError(
            f"reader state: the plan options differ ({diff}); another plan orders the "
            "batches differently, so resuming would repeat or skip data. Construct the "
            "ShardDataset with the options of the state (state['plan'], state['seed'])"
        )
    return options


def state_epoch(state: dict[str, Any]) -> int:
    """The state's epoch and cursor, checked as int64 (StateError); returns the epoch."""
    for name in ("epoch", "consumed"):
        value = state.get(name)
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**63:
            raise StateError(
                f"reader state: {name}={value!r}, expected an integer in [0, 2**63) (int64); "
                "pass the state that ShardDataset.state_dict() returned"
            )
    return int(state["epoch"])


def check_cursor(
    state: dict[str, Any], total: int, world_size: int, remixed: bool, path: str
) -> tuple[int, dict[str, Any] | None]:
    """The cursor to continue from in a plan of ``total`` batches, and a worker's own position.

    Raises StateError for a cursor past the plan's end (beyond what ``tail="wrap"`` reads).
    """
    epoch, consumed = state["epoch"], state["consumed"]
    if remixed:  # another mixture's plan: continue at the same place, within this plan
        consumed = min(consumed, total)
    their_world = state.get("world_size")
    slack = max(world_size, their_world if isinstance(their_world, int) else 1)
    if consumed > total + slack:  # tail="wrap" may run up to world_size - 1 past the end
        raise StateError(
            f"reader state: consumed={consumed} but epoch {epoch} of {path!r} has "
            f"{total} global batches; the state is damaged or belongs to another run: "
            "pass the state that ShardDataset.state_dict() returned"
        )
    worker = state.get("worker")  # (states of older versions lack its world_size)
    resume = {"world_size": state.get("world_size"), **worker} if isinstance(worker, dict) else None
    return consumed, resume
