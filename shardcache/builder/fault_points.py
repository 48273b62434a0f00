"""Named points of the build where a test may inject a fault.

The build calls :func:`fault_point` at each point; it does nothing unless a test installed a
:data:`hook` (a pytest fixture patches it; a subprocess's own launcher sets it, in pool and
Ray workers too). The points, in the order a build passes them:

* ``batch``: an encode batch of a partition written (its shards are open then);
* ``part``: a partition's completion record written, before it is published (a URL
  output uploads it then);
* ``commit``: 1 after the quarantine file, 2 after the merged shards and the length index,
  3 after publishing them, before the manifest;
* ``committed``: after the manifest is published, before the shards the merged ones
  replace are removed.
"""

from __future__ import annotations

from collections.abc import Callable

#: Called with the point's name at every point; None (the default) does nothing.
hook: Callable[[str], None] | None = None


def fault_point(event: str) -> None:
    """Pass a named point: call :data:`hook` with it when one is installed.

    Args:
        event: the point's name.
    """
    if hook is not None:
        hook(event)
