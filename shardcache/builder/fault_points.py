"""Named points of the build where a test may inject a fault.

``fault_point`` does nothing unless a test installed ``hook`` (a pytest fixture patches it; a
subprocess's own launcher sets it, in pool and Ray workers too). The points, in build order:
``batch`` (an encode batch written, its shards open); ``part`` (a completion record written,
before it is published); ``commit`` 1, 2, 3 (after the quarantine file; after the merged shards
and the length index; after publishing them, before the manifest); ``committed`` (after the
manifest is published, before the shards the merged ones replace are removed).
"""

from __future__ import annotations

from collections.abc import Callable

#: Called with the point's name at every point; None (the default) does nothing.
hook: Callable[[str], None] | None = None


def fault_point(event: str) -> None:
    """Pass the named point: call ``hook`` with it when one is installed."""
    if hook is not None:
        hook(event)
