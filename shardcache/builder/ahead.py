"""``Ahead``: one call run in a background thread, its value or exception taken later."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class Ahead(Generic[T]):
    """``fn(*args)`` in a background non-daemon thread; ``result`` re-raises what it raised."""

    def __init__(self, fn: Callable[..., T], *args: Any):
        self._value: T | None = None
        self._error: BaseException | None = None
        # not a daemon: a daemon killed inside fastokens at interpreter exit aborts the process
        self._thread = threading.Thread(
            target=self._run, args=(fn, args), name="shardcache-ahead", daemon=False
        )
        self._thread.start()

    def _run(self, fn: Callable[..., T], args: tuple[Any, ...]) -> None:
        try:
            self._value = fn(*args)
        except BaseException as err:  # re-raised in the caller
            self._error = err

    def done(self) -> bool:
        """Whether ``fn`` has returned or raised (``result`` then does not wait)."""
        return not self._thread.is_alive()

    def result(self) -> T:
        """Wait for ``fn``; return its value or re-raise the very exception it raised."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]
