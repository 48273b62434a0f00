"""Where a reader process stands: its rank, and the position it shares with its workers.

Also the global cursor of a torchdata ``StatefulDataLoader`` checkpoint, and the check that a
worker's own position is restored only into the same worker, ``num_workers`` and world size.
"""

from __future__ import annotations

import logging
import mmap
import os
from typing import Any

import numpy as np
import torch

from shardcache.config import check_int
from shardcache.errors import ConfigError, StateError

logger = logging.getLogger("shardcache")


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value.strip() == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ConfigError(
            f"{name} environment variable: got {value!r}, expected an integer (set by torchrun); "
            "fix or unset it, or pass rank= and world_size="
        ) from None


def process_group() -> tuple[int, int] | None:
    """Rank and world size of the torch.distributed process group, if one is initialised."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return None


def resolve_rank(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """Rank and world size: as passed, else the process group's, else RANK / WORLD_SIZE."""
    if (rank is None) != (world_size is None):
        given, missing = ("rank", "world_size") if world_size is None else ("world_size", "rank")
        raise ConfigError(
            f"rank/world_size: got {given}={rank if world_size is None else world_size} without "
            f"{missing}; pass both (or neither: then torch.distributed or RANK/WORLD_SIZE)"
        )
    if rank is not None and world_size is not None:
        check_int("rank", rank, 0)
        check_int("world_size", world_size, 1)
    else:
        rank, world_size = process_group() or (_env_int("RANK", 0), _env_int("WORLD_SIZE", 1))
    assert rank is not None and world_size is not None
    if world_size < 1 or not 0 <= rank < world_size:
        raise ConfigError(
            f"rank/world_size: got rank={rank}, world_size={world_size}; need "
            "0 <= rank < world_size"
        )
    return rank, world_size


class Ranks:
    """This process's rank and world size: as given, else followed from the process group.

    Args:
        rank: the rank, or None (with ``world_size`` None: torch.distributed, else the
            ``RANK`` / ``WORLD_SIZE`` variables).
        world_size: the number of ranks, or None.
    """

    def __init__(self, rank: int | None, world_size: int | None) -> None:
        self.rank, self.world_size = resolve_rank(rank, world_size)
        self.given = rank is not None  # else a process group started later is followed

    def follow(self, path: str, in_worker: bool) -> bool:
        """Take rank and world size from a process group started since; whether they changed.

        In the main process only (``in_worker`` False): workers get the main process's values.
        """
        if self.given or in_worker:
            return False
        group = process_group()
        if group is None or group == (self.rank, self.world_size):
            return False
        logger.info(
            "shardcache: ShardDataset(%r): rank %d of %d from the process group (it was %d of "
            "%d when built)", path, *group, self.rank, self.world_size,
        )  # fmt: skip
        self.rank, self.world_size = group
        return True


class SharedPosition:
    """``[generation, epoch, cursor, loaded]`` shared by a ShardDataset and its workers' copies.

    A shared mapping forks inherit, joined by a shared-memory tensor once pickled for spawned
    workers (without shared memory a copy keeps its position); the main process writes both.
    """

    def __init__(self) -> None:
        self._mapped: np.ndarray | None = np.frombuffer(mmap.mmap(-1, 32), dtype=np.int64)
        self._tensor: torch.Tensor | None = None

    def read(self) -> tuple[int, int, int, int]:
        """The published ``(generation, epoch, cursor, loaded)``."""
        source = self._tensor if self._tensor is not None else self._mapped
        assert source is not None  # (one of the two always exists)
        generation, epoch, cursor, loaded = (int(v) for v in source.tolist())
        return generation, epoch, cursor, loaded

    def publish(self, epoch: int, cursor: int, loaded: bool, in_worker: bool) -> int:
        """Publish a position for persistent workers' next pass; returns its generation.

        A worker only reads: it gets the generation its copy's position came from.
        """
        if in_worker:
            return self.read()[0]
        return self.write(epoch, cursor, loaded)

    def adopt(self, generation: int) -> tuple[int, int, int, bool] | None:
        """``(generation, epoch, cursor, loaded)`` published since ``generation``, else None."""
        published, epoch, cursor, loaded = self.read()
        if published == generation:
            return None
        return published, epoch, cursor, bool(loaded)

    def write(self, epoch: int, cursor: int, loaded: bool) -> int:
        """Publish a position (generation written last); returns its generation."""
        generation = self.read()[0] + 1
        values = [generation, epoch, cursor, int(loaded)]
        for target in (self._mapped, self._tensor):
            if target is not None:
                target[1:] = (
                    torch.tensor(values[1:]) if isinstance(target, torch.Tensor) else values[1:]
                )
                target[0] = generation  # last: a reader sees a complete position
        return generation

    def __getstate__(self) -> dict[str, Any]:
        if self._tensor is None:
            try:
                self._tensor = torch.tensor(self.read(), dtype=torch.int64).share_memory_()
            except RuntimeError as err:  # e.g. no /dev/shm: the copy keeps its position
                logger.debug("shardcache: no shared memory for the reader position (%s)", err)
                return {"tensor": torch.tensor(self.read(), dtype=torch.int64)}
        return {"tensor": self._tensor}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._mapped = None
        self._tensor = state["tensor"]


def dataset_state_of_loader(loader_state: dict[str, Any]) -> dict[str, Any] | None:
    """The dataset state (global cursor) in a torchdata ``StatefulDataLoader`` state, or None.

    The workers' positions together give the rank's global cursor, exact for any world size and
    ``num_workers`` to come.
    """
    if isinstance(loader_state.get("dataset_state"), dict) and "_num_yielded" in loader_state:
        return dict(loader_state["dataset_state"])
    snapshot = loader_state.get("_snapshot")
    if not isinstance(snapshot, dict) or not isinstance(snapshot.get("_worker_snapshots"), dict):
        return None
    workers = [w.get("dataset_state") if isinstance(w, dict) else None
               for w in snapshot["_worker_snapshots"].values()]  # fmt: skip
    if not workers or not all(isinstance(w, dict) for w in workers):
        raise StateError(
            "reader state: the StatefulDataLoader state holds no ShardDataset state for some "
            "workers; take the checkpoint with loader.state_dict() of a loader over a "
            "ShardDataset"
        )
    steps = loader_state.get("_steps_since_snapshot", 0)
    consumed = loader_state_cursor(workers, int(steps) if isinstance(steps, int) else 0)
    state = {k: v for k, v in workers[0].items() if k != "worker"}
    state["consumed"] = consumed
    return state


def loader_state_cursor(workers: list[dict[str, Any]], steps_since_snapshot: int = 0) -> int:
    """The global cursor of one rank's DataLoader worker states: ``start + world_size * taken``.

    ``steps_since_snapshot`` counts batches the loader yielded after the states were taken.
    """
    starts, worlds, epochs, taken = set(), set(), set(), steps_since_snapshot
    for state in workers:
        worker = state.get("worker")
        epochs.add(state.get("epoch"))
        worlds.add(state.get("world_size"))
        if isinstance(worker, dict):  # a worker that iterated
            starts.add(worker.get("start"))
            taken += int(worker.get("yielded", 0))
        else:  # a worker that has not started: at the cursor it was given
            starts.add(state.get("consumed"))
    if len(starts) != 1 or len(worlds) != 1 or len(epochs) != 1:
        raise StateError(
            f"reader state: the worker states of the StatefulDataLoader disagree (starts "
            f"{sorted(map(str, starts))}, world sizes {sorted(map(str, worlds))}, epochs "
            f"{sorted(map(str, epochs))}); they are not one loader's checkpoint: pass the "
            "dict loader.state_dict() returned, unmodified"
        )
    (start,), (world_size,) = starts, worlds
    if not isinstance(start, int) or not isinstance(world_size, int):
        raise StateError(
            f"reader state: start {start!r} / world_size {world_size!r} are not integers; "
            "pass the dict loader.state_dict() returned, unmodified"
        )
    return start + world_size * taken


def check_worker_resume(
    resume: dict[str, Any], worker_id: int, num_workers: int, world_size: int
) -> None:
    """Refuse a worker state of another worker, ``num_workers`` or world size (StateError)."""
    theirs = (resume.get("id"), resume.get("num_workers"), resume.get("world_size"))
    ours = (worker_id, num_workers, world_size)
    if theirs == ours:
        return
    raise StateError(
        f"reader state: a DataLoader worker state of worker {theirs[0]} of {theirs[1]} at "
        f"world_size {theirs[2]} is being restored into worker {ours[0]} of {ours[1]} at "
        f"world_size {ours[2]}; one worker's position does not give the global cursor "
        "once the ranks or workers change, so resuming from it would skip or repeat "
        "batches. Resume from the whole StatefulDataLoader checkpoint instead: "
        "ds.load_state_dict(loader_state) on the dataset before building the loader (any "
        "world size and num_workers), and do not call loader.load_state_dict"
    )
