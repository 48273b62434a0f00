"""Tests for shardcache.read.device_prefetch.DevicePrefetcher.

Most tests run the real prefetcher logic against ``FakeBackend``, a device simulated with threads:
the copy stream is a worker thread that performs each "H2D copy" late (after a delay, in chunks),
reading the pinned source only when the copy *runs*, as DMA does. In ``async`` mode the compute
stream is a worker thread too, so ``wait(stream, event)`` does not block the host and the test
reads delivered batches with "kernels" queued on the compute stream. Reusing a host slot before
its copy completed, or handing a batch out without ordering the compute stream after its copy,
therefore shows up as wrong data (device buffers start poisoned with 0xAB). In ``sync`` mode the
compute stream is the calling thread: waits block the host, so plain host reads are legal.

The ``gpu`` tests repeat the important checks on a real CUDA device when one exists.
"""

from __future__ import annotations

import dataclasses
import gc
import random
import threading
import time
import traceback
import weakref
from collections import OrderedDict, namedtuple
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardcache.errors import ConfigError
from shardcache.read.device_prefetch import (
    DeviceBackend,
    DevicePrefetcher,
    PrefetchOptions,
    PrefetchStats,
)
from shardcache.read.device_prefetch.tree import PACK_ALIGN, packed_offsets, packed_view

POISON = 0xAB
THREAD_NAME = "shardcache-prefetch"
FAST = PrefetchOptions(poll_interval_s=0.005, join_timeout_s=5.0)

# --------------------------------------------------------------------------------------------
# The fake device
# --------------------------------------------------------------------------------------------


class FakeEvent:
    def __init__(self, timing: bool) -> None:
        self.timing = timing
        self.done = threading.Event()
        self.time_s: float | None = None

    def fire(self) -> None:
        self.time_s = time.perf_counter()
        self.done.set()


class FakeStream:
    """A device stream: one worker thread running submitted ops in FIFO order."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._ops: list[Callable[[], None] | None] = []
        self._cv = threading.Condition()
        self.thread = threading.Thread(target=self._run, name=f"fake-{name}", daemon=True)
        self.thread.start()

    def submit(self, op: Callable[[], None]) -> None:
        with self._cv:
            self._ops.append(op)
            self._cv.notify()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._ops:
                    self._cv.wait()
                op = self._ops.pop(0)
            if op is None:
                return
            op()

    def shutdown(self) -> None:
        with self._cv:
            self._ops.append(None)
            self._cv.notify()
        self.thread.join(5)


class HostStream:
    """The compute stream in sync mode: work runs on the calling thread, waits block it."""

    name = "compute"


class FakeBackend:
    """A DeviceBackend whose copies are asynchronous and read their source late."""

    def __init__(self, mode: str = "async", copy_delay_s: float = 0.0, seed: int = 0) -> None:
        self.device = torch.device("cpu")
        self.mode = mode
        self.copy_delay_s = copy_delay_s
        self.rng = random.Random(seed)
        self.compute: FakeStream | HostStream = (
            FakeStream("compute") if mode == "async" else HostStream()
        )
        self.streams: list[FakeStream] = []
        self.log: list[tuple[Any, ...]] = []
        self.lock = threading.Lock()
        self.pinned_live_bytes = 0
        self.pinned_allocs = 0
        self.pinned_refs: list[weakref.ref[torch.Tensor]] = []
        self.init_threads: list[str] = []
        self.wait_failures = 0

    # -- DeviceBackend --
    def current_stream(self) -> Any:
        return self.compute

    def new_stream(self, priority: int) -> FakeStream:
        stream = FakeStream("copy")
        self.streams.append(stream)
        return stream

    def new_event(self, timing: bool) -> FakeEvent:
        return FakeEvent(timing)

    def record(self, event: FakeEvent, stream: Any) -> None:
        self.log.append(("record", event, stream.name))
        if isinstance(stream, FakeStream):
            stream.submit(event.fire)
        else:
            event.fire()

    def wait(self, stream: Any, event: FakeEvent) -> None:
        self.log.append(("wait", stream.name, event))
        if isinstance(stream, FakeStream):
            stream.submit(lambda: self._block(event))
        else:
            self._block(event)

    def _block(self, event: FakeEvent) -> None:
        if not event.done.wait(10):
            self.wait_failures += 1

    def query(self, event: FakeEvent) -> bool:
        return event.done.is_set()

    def synchronize(self, event: FakeEvent) -> None:
        self._block(event)

    def elapsed_ms(self, start: FakeEvent, end: FakeEvent) -> float:
        assert start.timing and end.timing and start.done.is_set() and end.done.is_set()
        return 1e3 * (end.time_s - start.time_s)  # type: ignore[operator]

    def alloc_pinned(self, nbytes: int) -> torch.Tensor:
        t = torch.empty(nbytes, dtype=torch.uint8)
        with self.lock:
            self.pinned_live_bytes += nbytes
            self.pinned_allocs += 1
        weakref.finalize(t, self._unpin, nbytes)
        self.pinned_refs.append(weakref.ref(t))
        return t

    def _unpin(self, nbytes: int) -> None:
        with self.lock:
            self.pinned_live_bytes -= nbytes

    def alloc_device(self, nbytes: int) -> torch.Tensor:
        t = torch.full((nbytes,), POISON, dtype=torch.uint8)
        self.log.append(("alloc", t, self.current_stream().name))
        return t

    def copy_async(self, dst: torch.Tensor, src: torch.Tensor, stream: FakeStream) -> None:
        self.log.append(("copy", dst, stream.name))
        delay = self.copy_delay_s * (0.5 + self.rng.random())

        def op() -> None:
            # Like DMA: the source is read when the copy runs, in pieces, not when enqueued.
            half = dst.numel() // 2
            if delay:
                time.sleep(delay)
            dst[:half].copy_(src[:half])
            if delay:
                time.sleep(delay / 4)
            dst[half:].copy_(src[half:])

        stream.submit(op)

    def init_thread(self) -> None:
        self.init_threads.append(threading.current_thread().name)

    # -- test helpers --
    def launch(self, kernel: Callable[[], None]) -> None:
        """Run ``kernel`` on the compute stream (in order with the waits the prefetcher put)."""
        if isinstance(self.compute, FakeStream):
            self.compute.submit(kernel)
        else:
            kernel()

    def drain(self) -> None:
        for stream in [*self.streams, self.compute]:
            if isinstance(stream, FakeStream):
                ev = FakeEvent(False)
                stream.submit(ev.fire)
                assert ev.done.wait(10), f"fake stream {stream.name} is stuck"

    def shutdown(self) -> None:
        for stream in [*self.streams, self.compute]:
            if isinstance(stream, FakeStream):
                stream.shutdown()


@pytest.fixture
def make_backend() -> Iterator[Callable[..., FakeBackend]]:
    made: list[FakeBackend] = []

    def make(**kwargs: Any) -> FakeBackend:
        backend = FakeBackend(**kwargs)
        made.append(backend)
        return backend

    yield make
    for backend in made:
        backend.shutdown()


# --------------------------------------------------------------------------------------------
# Batches and comparison
# --------------------------------------------------------------------------------------------

Pair = namedtuple("Pair", ["ids", "meta"])


@dataclasses.dataclass
class Sample:
    input_ids: torch.Tensor
    mask: torch.Tensor
    name: str
    extra: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Frozen:
    x: torch.Tensor
    n: int
    y: torch.Tensor = dataclasses.field(default_factory=lambda: torch.zeros(1))
    note: str = dataclasses.field(default="", init=False)


DTYPES = [torch.int64, torch.int32, torch.uint8, torch.bool, torch.float16, torch.float32]


def rand_tensor(g: torch.Generator, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    hi = 250 if dtype == torch.uint8 else 1 << 30
    return torch.randint(0, hi, shape, generator=g, dtype=torch.int64).to(dtype)


def make_batch(i: int, seed: int = 0) -> Any:
    """Batch ``i`` of a varied stream: container type, shapes and dtypes depend on ``i``."""
    g = torch.Generator().manual_seed(seed * 1000 + i)
    rows, cols = 1 + i % 4, (i * 37) % 300
    kind = i % 6
    if kind == 0:
        return {
            "input_ids": rand_tensor(g, (rows, cols), torch.int64),
            "attention_mask": rand_tensor(g, (rows, cols), torch.bool),
            "labels": rand_tensor(g, (rows, cols), torch.int32),
            "sample_ids": rand_tensor(g, (rows,), torch.int64),
            "source": f"shard-{i:05d}",
        }
    if kind == 1:
        return [rand_tensor(g, (cols,), torch.uint8), i, rand_tensor(g, (), torch.float32)]
    if kind == 2:
        return (rand_tensor(g, (rows, 3), torch.float16), None, rand_tensor(g, (0, 5), torch.int64))
    if kind == 3:
        return Pair(ids=rand_tensor(g, (rows, cols), torch.int32), meta={"step": i})
    if kind == 4:
        return Sample(
            input_ids=rand_tensor(g, (rows, cols + 1), torch.int64),
            mask=rand_tensor(g, (rows, cols + 1), torch.bool),
            name=f"s{i}",
            extra={"nested": OrderedDict(a=rand_tensor(g, (2, 2), torch.int32), b=1.5)},
        )
    return Frozen(x=rand_tensor(g, (cols + 3,), torch.int64), n=i)


def clone_tree(obj: Any) -> Any:
    """A host copy of a delivered batch, preserving container types (taken when it runs)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        new = obj.copy()
        for k, v in obj.items():
            new[k] = clone_tree(v)
        return new
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(clone_tree(v) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(clone_tree(v) for v in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        new = dataclasses.replace(obj) if all(f.init for f in dataclasses.fields(obj)) else obj
        for f in dataclasses.fields(obj):
            object.__setattr__(new, f.name, clone_tree(getattr(obj, f.name)))
        return new
    return obj


def assert_same(expected: Any, actual: Any, path: str = "batch") -> None:
    """Bit-exact equality, same container types, non-tensors passed through by identity."""
    assert type(actual) is type(expected), f"{path}: {type(actual)} != {type(expected)}"
    if isinstance(expected, torch.Tensor):
        assert actual.dtype == expected.dtype, f"{path}: dtype {actual.dtype}"
        assert actual.shape == expected.shape, f"{path}: shape {actual.shape}"
        assert torch.equal(actual.cpu(), expected), f"{path}: content differs"
    elif isinstance(expected, dict):
        assert list(actual) == list(expected), f"{path}: keys"
        for k in expected:
            assert_same(expected[k], actual[k], f"{path}[{k!r}]")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), f"{path}: length"
        for j, (e, a) in enumerate(zip(expected, actual, strict=True)):
            assert_same(e, a, f"{path}[{j}]")
    elif dataclasses.is_dataclass(expected):
        for f in dataclasses.fields(expected):
            assert_same(getattr(expected, f.name), getattr(actual, f.name), f"{path}.{f.name}")
    else:
        assert actual is expected, f"{path}: {actual!r} is not the original object"


def consume(pf: DevicePrefetcher, backend: FakeBackend, limit: int | None = None) -> list[Any]:
    """Read every delivered batch with a kernel on the compute stream; return the host copies."""
    out: list[Any] = []
    for k, batch in enumerate(pf):
        backend.launch(lambda b=batch: out.append(clone_tree(b)))
        if limit is not None and k + 1 >= limit:
            break
    backend.drain()
    return out


def prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == THREAD_NAME]


class CountingSource:
    """An iterable whose batches are ``make_batch(i)``; records how far it was read."""

    def __init__(self, n: int, make: Callable[[int], Any] = make_batch) -> None:
        self.n = n
        self.make = make
        self.pulled = 0
        self.max_ahead = 0
        self.pf: DevicePrefetcher | None = None

    def __iter__(self) -> Iterator[Any]:
        self.pulled = 0
        for i in range(self.n):
            self.pulled += 1
            if self.pf is not None:
                ahead = self.pulled - self.pf.stats().batches
                self.max_ahead = max(self.max_ahead, ahead)
            yield self.make(i)

    def __len__(self) -> int:
        return self.n


# --------------------------------------------------------------------------------------------
# The fake itself can see the race
# --------------------------------------------------------------------------------------------


def test_fake_copy_reads_source_late(make_backend: Callable[..., FakeBackend]) -> None:
    backend = make_backend(copy_delay_s=0.005)
    stream = backend.new_stream(0)
    src = torch.full((64,), 1, dtype=torch.uint8)
    dst = backend.alloc_device(64)
    backend.copy_async(dst, src, stream)
    src.fill_(2)  # overwrite the source before the copy ran: the fake must show it
    backend.drain()
    assert torch.equal(dst, torch.full((64,), 2, dtype=torch.uint8))


def test_fake_backend_satisfies_protocol(make_backend: Callable[..., FakeBackend]) -> None:
    assert isinstance(make_backend(), DeviceBackend)


# --------------------------------------------------------------------------------------------
# Order, content, containers
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("depth", [1, 2, 4])
def test_order_and_content_async(make_backend: Callable[..., FakeBackend], depth: int) -> None:
    backend = make_backend(copy_delay_s=0.001, seed=depth)
    expected = [make_batch(i) for i in range(36)]
    with DevicePrefetcher(expected, depth=depth, options=FAST, backend=backend) as pf:
        got = consume(pf, backend)
    assert len(got) == len(expected)
    for e, a in zip(expected, got, strict=True):
        assert_same(e, a)
    assert backend.wait_failures == 0


@pytest.mark.parametrize("depth", [1, 2])
def test_slot_reuse_waits_for_copy(make_backend: Callable[..., FakeBackend], depth: int) -> None:
    """Slow copies, fast packer: a slot rewritten before its copy ran corrupts later batches."""
    backend = make_backend(copy_delay_s=0.003, seed=7)
    expected = [
        {
            "ids": torch.full((257 + i,), i, dtype=torch.int64),
            "k": torch.arange(i, dtype=torch.int32),
        }
        for i in range(40)
    ]
    with DevicePrefetcher(expected, depth=depth, options=FAST, backend=backend) as pf:
        got = consume(pf, backend)
    for e, a in zip(expected, got, strict=True):
        assert_same(e, a)


def test_consumer_stream_waits_for_copy(make_backend: Callable[..., FakeBackend]) -> None:
    """Sync compute stream: a batch read on the host right after next() must be complete."""
    backend = make_backend(mode="sync", copy_delay_s=0.002)
    expected = [make_batch(i) for i in range(24)]
    with DevicePrefetcher(expected, depth=2, options=FAST, backend=backend) as pf:
        for e, a in zip(expected, pf, strict=True):
            assert_same(e, a)  # plain host read, no drain: the hand-off must have waited


def test_copy_is_fenced_after_device_allocation(make_backend: Callable[..., FakeBackend]) -> None:
    """Each copy writes a buffer allocated on the compute stream, after the copy stream waited
    on an event recorded on the compute stream after that allocation (deterministic reuse)."""
    backend = make_backend(copy_delay_s=0.0005)
    batches = [make_batch(i) for i in range(10)]
    with DevicePrefetcher(batches, depth=2, options=FAST, backend=backend) as pf:
        consume(pf, backend)
    log = backend.log
    copies = [i for i, e in enumerate(log) if e[0] == "copy"]
    assert len(copies) == len(batches)
    for ci in copies:
        dst = log[ci][1]
        ai = max(i for i in range(ci) if log[i][0] == "alloc" and log[i][1] is dst)
        assert log[ai][2] == "compute"
        fences = {id(e[1]) for e in log[ai:ci] if e[0] == "record" and e[2] == "compute"}
        waits = {id(e[2]) for e in log[ai:ci] if e[0] == "wait" and e[1] == "copy"}
        assert fences & waits, f"copy at log[{ci}] is not fenced after its allocation"
    # and every hand-off made the compute stream wait on that batch's copy-done event
    assert sum(1 for e in log if e[0] == "wait" and e[1] == "compute") == len(batches)


def test_cast_on_device(make_backend: Callable[..., FakeBackend]) -> None:
    backend = make_backend(mode="sync", copy_delay_s=0.0005)
    src = [
        {
            "input_ids": torch.arange(i, i + 300, dtype=torch.int32).view(3, 100),
            "mask": torch.ones(3, 100, dtype=torch.bool),
            "f": torch.full((4,), 0.5, dtype=torch.float16),
        }
        for i in range(6)
    ]
    cast = {torch.int32: torch.int64, torch.float16: torch.float32}
    with DevicePrefetcher(src, cast=cast, options=FAST, backend=backend) as pf:
        for s, out in zip(src, pf, strict=True):
            assert out["input_ids"].dtype == torch.int64
            assert torch.equal(out["input_ids"], s["input_ids"].long())
            assert out["mask"].dtype == torch.bool and bool(out["mask"].all())
            assert out["f"].dtype == torch.float32 and torch.equal(out["f"], s["f"].float())
        stats = pf.stats()
    # the int32 ids were shipped at 4 bytes each: 1200 + 300 (bool) + 8 (fp16), 256-aligned
    assert stats.bytes_copied == 6 * (1280 + 512 + 256)


def test_non_cpu_and_non_tensor_values_pass_through(
    make_backend: Callable[..., FakeBackend],
) -> None:
    backend = make_backend(mode="sync")
    marker = object()
    meta = torch.empty(2, 3, device="meta")
    batch = {"t": torch.arange(5), "obj": marker, "meta": meta, "s": "x", "n": None}
    with DevicePrefetcher([batch], options=FAST, backend=backend) as pf:
        (out,) = list(pf)
    assert out["obj"] is marker and out["meta"] is meta and out["s"] == "x" and out["n"] is None
    assert torch.equal(out["t"], batch["t"])


def test_empty_source(make_backend: Callable[..., FakeBackend]) -> None:
    with DevicePrefetcher([], options=FAST, backend=make_backend()) as pf:
        assert list(pf) == []
        assert list(pf) == []
    assert not prefetch_threads()


# --------------------------------------------------------------------------------------------
# Backpressure
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_backpressure_bound_is_exact(make_backend: Callable[..., FakeBackend], depth: int) -> None:
    backend = make_backend(mode="sync")
    source = CountingSource(30)
    pf = DevicePrefetcher(source, depth=depth, options=FAST, backend=backend)
    source.pf = pf
    it = iter(pf)
    next(it)  # starts the packer
    deadline = time.monotonic() + 10
    while source.pulled < 1 + depth + 1 and time.monotonic() < deadline:
        time.sleep(0.001)
    time.sleep(0.02)  # give an over-eager packer the chance to read further
    assert source.pulled == 1 + depth + 1  # exactly depth staged + one being packed
    for _ in it:
        time.sleep(0.0005)  # a slow consumer keeps the packer at the bound
    pf.close()
    assert source.max_ahead == depth + 1
    assert pf.stats().batches == 30


# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------


def failing_source(n_ok: int) -> Iterator[dict[str, torch.Tensor]]:
    for i in range(n_ok):
        yield {"x": torch.full((8,), i)}
    raise ValueError("shard-00003 is truncated")


def test_upstream_exception_keeps_traceback(make_backend: Callable[..., FakeBackend]) -> None:
    backend = make_backend(mode="sync", copy_delay_s=0.0005)

    class Source:
        def __iter__(self) -> Iterator[Any]:
            return failing_source(3)

    pf = DevicePrefetcher(Source(), options=FAST, backend=backend)
    it = iter(pf)
    seen = [int(next(it)["x"][0]) for _ in range(3)]
    with pytest.raises(ValueError, match="shard-00003 is truncated") as info:
        next(it)
    assert seen == [0, 1, 2]
    frames = [f.name for f in traceback.extract_tb(info.value.__traceback__)]
    assert "failing_source" in frames  # the upstream frame is part of the traceback
    with pytest.raises(StopIteration):
        next(it)
    assert not prefetch_threads()
    pf.close()


def test_batch_larger_than_pinned_cap(make_backend: Callable[..., FakeBackend]) -> None:
    opts = dataclasses.replace(FAST, max_pinned_bytes=3 * 4096)
    src = [{"x": torch.zeros(100, dtype=torch.int64)}, {"x": torch.zeros(1000, dtype=torch.int64)}]
    with DevicePrefetcher(src, depth=2, options=opts, backend=make_backend()) as pf:
        it = iter(pf)
        next(it)
        with pytest.raises(ConfigError, match="max_pinned_bytes=12288"):
            next(it)
    assert not prefetch_threads()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_pinned_bytes": 0}, "max_pinned_bytes: got 0"),
        ({"max_pinned_bytes": 1.5}, "max_pinned_bytes: got 1.5"),
        ({"min_slot_bytes": -1}, "min_slot_bytes: got -1"),
        ({"copy_stream_priority": 100}, r"copy_stream_priority: got 100.*\[-64, 64\]"),
        ({"timing": 1}, "timing: got 1"),
        ({"poll_interval_s": 0}, r"poll_interval_s: got 0.*\[0.0001, 10.0\]"),
        ({"join_timeout_s": "5"}, "join_timeout_s: got '5'"),
    ],
)
def test_options_validated(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        PrefetchOptions(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"depth": 0}, r"depth=0.*\[1, 64\]"),
        ({"depth": True}, "depth=True"),
        ({"cast": {"int32": torch.int64}}, "cast="),
        ({"options": {"timing": False}}, "options="),
    ],
)
def test_constructor_validated(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        DevicePrefetcher([], **kwargs)


def test_cuda_device_without_cuda_is_config_error() -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA is present")
    with pytest.raises(ConfigError, match="device='cuda'"):
        DevicePrefetcher([], device="cuda")


# --------------------------------------------------------------------------------------------
# Shutdown and lifetimes
# --------------------------------------------------------------------------------------------


def test_close_with_copies_in_flight(make_backend: Callable[..., FakeBackend]) -> None:
    backend = make_backend(copy_delay_s=0.005)
    pf = DevicePrefetcher(
        [make_batch(i) for i in range(20)], depth=4, options=FAST, backend=backend
    )
    it = iter(pf)
    next(it)
    next(it)
    pf.close()  # copies for the next batches were issued and are still running
    assert not prefetch_threads()
    copy_done = [e[1] for e in backend.log if e[0] == "record" and e[2] == "copy"]
    assert copy_done and all(ev.done.is_set() for ev in copy_done)
    assert pf.stats().pinned_bytes == 0 and pf.stats().slots == 0
    with pytest.raises(StopIteration):
        next(it)
    pf.close()  # idempotent
    del it
    gc.collect()
    assert backend.pinned_live_bytes == 0


def test_break_stops_the_thread(make_backend: Callable[..., FakeBackend]) -> None:
    backend = make_backend(copy_delay_s=0.001)
    src = [make_batch(i) for i in range(50)]
    pf = DevicePrefetcher(src, options=FAST, backend=backend)
    for k, _batch in enumerate(pf):
        assert len(prefetch_threads()) == 1
        if k == 3:
            break
    assert not prefetch_threads()  # the loop's generator was closed and stopped the epoch
    # the prefetcher stays usable: a new epoch starts from the beginning
    got = consume(pf, backend, limit=2)
    assert_same(src[0], got[0])
    assert_same(src[1], got[1])
    pf.close()


def test_exception_in_loop_body(make_backend: Callable[..., FakeBackend]) -> None:
    backend = make_backend()
    with (
        pytest.raises(RuntimeError, match="boom"),
        DevicePrefetcher([make_batch(i) for i in range(9)], options=FAST, backend=backend) as pf,
    ):
        for _ in pf:
            raise RuntimeError("boom")
    assert not prefetch_threads()


def test_garbage_collection(make_backend: Callable[..., FakeBackend]) -> None:
    backend = make_backend(copy_delay_s=0.001)
    pf = DevicePrefetcher([make_batch(i) for i in range(30)], options=FAST, backend=backend)
    it = iter(pf)
    next(it)
    assert len(prefetch_threads()) == 1
    ref = weakref.ref(pf)
    del pf, it
    gc.collect()
    assert ref() is None
    assert not prefetch_threads()
    # The copy of the batch already handed out may still be running on the (fake) copy
    # engine, which holds its source slot until it finishes, as CUDA's host allocator holds a
    # pinned block until the copies recorded on it completed. Once the device drained, no
    # pinned slot may be left alive: the dropped prefetcher must not keep any.
    backend.drain()
    gc.collect()
    assert backend.pinned_live_bytes == 0
    assert backend.pinned_refs, "no pinned buffer was made: the test did not test their release"
    assert all(r() is None for r in backend.pinned_refs)


def test_close_while_packer_waits_for_slot(make_backend: Callable[..., FakeBackend]) -> None:
    """The packer is parked at the backpressure bound; close() must still stop it promptly."""
    backend = make_backend(mode="sync")
    source = CountingSource(100)
    pf = DevicePrefetcher(source, depth=2, options=FAST, backend=backend)
    it = iter(pf)
    next(it)
    deadline = time.monotonic() + 10
    while source.pulled < 4 and time.monotonic() < deadline:
        time.sleep(0.001)
    pf.close()
    assert not prefetch_threads()
    del it


def test_close_while_upstream_blocks(make_backend: Callable[..., FakeBackend]) -> None:
    """A packer stuck inside the upstream next() cannot be interrupted: close() warns after
    join_timeout_s and the daemon thread exits once the upstream returns."""
    release = threading.Event()

    def stuck() -> Iterator[Any]:
        yield {"x": torch.zeros(4)}
        release.wait(10)
        yield {"x": torch.ones(4)}

    class Source:
        def __iter__(self) -> Iterator[Any]:
            return stuck()

    opts = dataclasses.replace(FAST, join_timeout_s=0.05)
    pf = DevicePrefetcher(Source(), options=opts, backend=make_backend(mode="sync"))
    it = iter(pf)
    next(it)
    with pytest.warns(ResourceWarning, match="did not stop within"):
        pf.close()
    (thread,) = prefetch_threads()
    release.set()
    thread.join(5)
    assert not thread.is_alive()
    del it


def test_reiterating_restarts_the_epoch(make_backend: Callable[..., FakeBackend]) -> None:
    backend = make_backend(mode="sync")
    src = [{"i": torch.tensor([i])} for i in range(10)]
    with DevicePrefetcher(src, options=FAST, backend=backend) as pf:
        first = iter(pf)
        assert int(next(first)["i"]) == 0
        second = iter(pf)
        assert [int(b["i"]) for b in second] == list(range(10))
        assert list(first) == []  # the old epoch was stopped
        assert len(prefetch_threads()) == 0


def test_many_epochs_no_thread_or_pinned_growth(make_backend: Callable[..., FakeBackend]) -> None:
    backend = make_backend(copy_delay_s=0.0002)
    src = [make_batch(i) for i in range(12)]
    with DevicePrefetcher(src, depth=2, options=FAST, backend=backend) as pf:
        consume(pf, backend)
        threads, pinned = threading.active_count(), pf.stats().pinned_bytes
        allocs = backend.pinned_allocs
        for _ in range(25):
            got = consume(pf, backend)
            assert len(got) == len(src)
            assert threading.active_count() == threads
            assert pf.stats().pinned_bytes == pinned
        assert backend.pinned_allocs == allocs
        assert pf.stats().slots == 3
        assert pf.stats().batches == 26 * len(src)
    assert threading.active_count() == threads  # no prefetch thread was alive at the baseline


def test_slot_growth_powers_of_two_and_capped(make_backend: Callable[..., FakeBackend]) -> None:
    backend = make_backend(mode="sync")
    opts = dataclasses.replace(FAST, min_slot_bytes=1024, max_pinned_bytes=3 << 20)
    sizes = [10, 100, 1000, 5000, 20000, 100, 20000, 7, 60000]
    src = [{"x": torch.zeros(n, dtype=torch.int64)} for n in sizes]
    with DevicePrefetcher(src, depth=2, options=opts, backend=backend) as pf:
        assert len(list(pf)) == len(sizes)
        grows = pf.stats().slot_grows
        assert len(list(pf)) == len(sizes)  # second epoch: sizes already seen, no growth
        stats = pf.stats()
        live = [c.numel() for c in (r() for r in backend.pinned_refs) if c is not None]
    assert stats.slot_grows == grows
    assert all(n & (n - 1) == 0 and n >= 1024 for n in live)  # powers of two, >= min_slot
    assert stats.pinned_bytes <= opts.max_pinned_bytes
    assert stats.pinned_bytes == sum(live) and len(live) == 3


# --------------------------------------------------------------------------------------------
# Metrics and thread hygiene
# --------------------------------------------------------------------------------------------


def test_stats(make_backend: Callable[..., FakeBackend]) -> None:
    backend = make_backend(copy_delay_s=0.0005)
    src = [{"x": torch.zeros(1000, dtype=torch.int32)} for _ in range(15)]
    with DevicePrefetcher(src, depth=2, options=FAST, backend=backend) as pf:
        for _ in pf:
            snapshot = pf.stats()  # never blocks: copies still in flight are simply not counted
            assert snapshot.copies_timed <= snapshot.batches + 2
    stats = pf.stats()
    assert isinstance(stats, PrefetchStats) and not stats.passthrough
    assert stats.batches == 15
    assert stats.bytes_copied == 15 * 4096
    assert stats.copies_timed == 15  # close() resolved the remaining timing events
    assert stats.copy_bytes_timed == 15 * 4096 and stats.copy_s > 0 and stats.copy_gbps > 0
    assert stats.mean_copy_ms > 0
    assert 0 <= stats.queue_depth_min <= stats.queue_depth_mean <= 3
    assert stats.consumer_wait_s >= 0 and stats.consumer_next_s >= stats.consumer_wait_s
    assert stats.source_wait_s >= 0 and stats.pack_s > 0


def test_timing_off(make_backend: Callable[..., FakeBackend]) -> None:
    opts = dataclasses.replace(FAST, timing=False)
    backend = make_backend()
    with DevicePrefetcher([make_batch(i) for i in range(5)], options=opts, backend=backend) as pf:
        assert len(consume(pf, backend)) == 5
    assert pf.stats().copies_timed == 0
    assert not any(e[0] == "record" and e[1].timing for e in backend.log)


def test_packer_thread_hygiene(make_backend: Callable[..., FakeBackend]) -> None:
    backend = make_backend(mode="sync")
    seen: list[tuple[str, bool, int]] = []

    def source() -> Iterator[Any]:
        for i in range(3):
            t = threading.current_thread()
            seen.append((t.name, t.daemon, torch.get_num_threads()))
            yield {"i": torch.tensor([i])}

    class Source:
        def __iter__(self) -> Iterator[Any]:
            return source()

    with DevicePrefetcher(Source(), options=FAST, backend=backend) as pf:
        list(pf)
    assert seen and all(s == (THREAD_NAME, True, 1) for s in seen)
    assert backend.init_threads == [THREAD_NAME]


def test_len_forwards() -> None:
    assert len(DevicePrefetcher(CountingSource(7), device="cpu")) == 7


# --------------------------------------------------------------------------------------------
# Pass-through without an accelerator (real torch backend selection)
# --------------------------------------------------------------------------------------------


@pytest.fixture
def no_pinning(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("pin_memory() must not be called without an accelerator")

    real_empty = torch.empty

    def empty(*args: Any, **kwargs: Any) -> torch.Tensor:
        if kwargs.get("pin_memory"):
            raise AssertionError("torch.empty(pin_memory=True) must not be called")
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "pin_memory", refuse)
    monkeypatch.setattr(torch, "empty", empty)


@pytest.mark.skipif(torch.cuda.is_available(), reason="pass-through needs a CPU-only torch")
@pytest.mark.parametrize("device", [None, "cpu"])
@pytest.mark.usefixtures("no_pinning")
def test_passthrough_on_cpu(device: str | None) -> None:
    src = [make_batch(i) for i in range(12)]
    with DevicePrefetcher(src, device=device, depth=3) as pf:
        assert pf.passthrough and pf.device == torch.device("cpu")
        got = list(pf)
        assert list(pf) == got  # epochs
    assert all(a is e for a, e in zip(got, src, strict=True))  # handed out as they came
    stats = pf.stats()
    assert stats.passthrough and stats.batches == 24 and stats.pinned_bytes == 0
    assert not prefetch_threads()


@pytest.mark.skipif(torch.cuda.is_available(), reason="pass-through needs a CPU-only torch")
@pytest.mark.usefixtures("no_pinning")
def test_passthrough_cast_and_errors() -> None:
    src = [{"ids": torch.arange(4, dtype=torch.int32), "s": "a"}]
    with DevicePrefetcher(src, cast={torch.int32: torch.int64}) as pf:
        (out,) = list(pf)
    assert out["ids"].dtype == torch.int64 and out["s"] == "a"

    class Source:
        def __iter__(self) -> Iterator[Any]:
            return failing_source(2)

    with DevicePrefetcher(Source()) as pf:
        it = iter(pf)
        next(it), next(it)
        with pytest.raises(ValueError, match="truncated") as info:
            next(it)
    assert "failing_source" in [f.name for f in traceback.extract_tb(info.value.__traceback__)]


@pytest.mark.skipif(torch.cuda.is_available(), reason="pass-through needs a CPU-only torch")
@pytest.mark.usefixtures("no_pinning")
def test_passthrough_with_dataloader_workers() -> None:
    import multiprocessing

    from torch.utils.data import DataLoader, IterableDataset

    class Batches(IterableDataset):
        def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
            info = torch.utils.data.get_worker_info()
            wid = info.id if info is not None else 0
            for i in range(4):
                yield {"input_ids": torch.full((2, 8), 10 * wid + i, dtype=torch.int64)}

    loader = DataLoader(Batches(), batch_size=None, num_workers=2, pin_memory=False)
    with DevicePrefetcher(loader) as pf:
        got = sorted(int(b["input_ids"][0, 0]) for b in pf)
    assert got == [0, 1, 2, 3, 10, 11, 12, 13]
    for child in multiprocessing.active_children():
        child.join(5)
    assert not multiprocessing.active_children()


# --------------------------------------------------------------------------------------------
# Properties
# --------------------------------------------------------------------------------------------

shape_st = st.lists(st.integers(0, 40), min_size=0, max_size=3).map(tuple)
batch_st = st.dictionaries(
    st.sampled_from(["input_ids", "attention_mask", "labels", "sample_ids", "pos"]),
    st.tuples(shape_st, st.sampled_from(DTYPES)),
    min_size=0,
    max_size=5,
)


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    specs=st.lists(batch_st, min_size=0, max_size=12),
    depth=st.integers(1, 4),
    seed=st.integers(0, 2**16),
)
def test_random_shape_sequences_round_trip(
    make_backend: Callable[..., FakeBackend],
    specs: list[dict[str, tuple[tuple[int, ...], torch.dtype]]],
    depth: int,
    seed: int,
) -> None:
    g = torch.Generator().manual_seed(seed)
    src = [{k: rand_tensor(g, shape, dt) for k, (shape, dt) in spec.items()} for spec in specs]
    backend = make_backend(copy_delay_s=0.0002, seed=seed)
    opts = dataclasses.replace(FAST, min_slot_bytes=256)
    try:
        with DevicePrefetcher(src, depth=depth, options=opts, backend=backend) as pf:
            got = consume(pf, backend)
    finally:
        backend.shutdown()
    assert len(got) == len(src)
    for e, a in zip(src, got, strict=True):
        assert_same(e, a)


# --------------------------------------------------------------------------------------------
# Real CUDA device (skipped without one)
# --------------------------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("depth", [1, 2, 4])
def test_gpu_order_content_and_lifetime(depth: int) -> None:
    src = [make_batch(i) for i in range(60)]
    before = threading.active_count()
    with DevicePrefetcher(src, device="cuda", depth=depth) as pf:
        got = []
        for batch in pf:
            torch.cuda._sleep(200_000)  # slow compute: copies run ahead and slots get reused
            got.append(clone_tree(batch))
        stats = pf.stats()
    torch.cuda.synchronize()
    for e, a in zip(src, got, strict=True):
        assert_same(e, a)
    assert stats.batches == len(src) and stats.slots == depth + 1
    assert threading.active_count() == before


@pytest.mark.gpu
@needs_cuda
def test_gpu_cast_and_delivered_batches_stay_valid() -> None:
    src = [{"ids": torch.arange(i, i + 4096, dtype=torch.int32)} for i in range(40)]
    kept = []
    with DevicePrefetcher(src, device="cuda", cast={torch.int32: torch.int64}) as pf:
        for batch in pf:
            assert batch["ids"].is_cuda and batch["ids"].dtype == torch.int64
            kept.append(batch)  # holding every batch is allowed: nothing is overwritten
    torch.cuda.synchronize()
    for i, batch in enumerate(kept):
        assert torch.equal(batch["ids"].cpu(), torch.arange(i, i + 4096))


def test_packed_tensors_come_back_as_aligned_views_of_one_buffer():
    tensors = [
        torch.arange(7, dtype=torch.int8),
        torch.arange(12, dtype=torch.float64).reshape(3, 4).t(),  # not contiguous
        torch.zeros(0, dtype=torch.int32),
        torch.tensor([True, False, True]),
    ]
    offsets, used = packed_offsets(tensors)
    assert all(at % PACK_ALIGN == 0 for at in offsets) and used % PACK_ALIGN == 0
    buffer = torch.zeros(used, dtype=torch.uint8)
    for t, at in zip(tensors, offsets):
        packed_view(buffer, at, t.dtype, t.shape).copy_(t)
    for t, at in zip(tensors, offsets):
        back = packed_view(buffer, at, t.dtype, t.shape)
        assert back.dtype == t.dtype and back.shape == t.shape and torch.equal(back, t)
        assert back.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
