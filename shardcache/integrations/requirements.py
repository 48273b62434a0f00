"""The optional frameworks of the integrations: imported on use, missing ones named with the fix.

Every framework an integration needs beyond shardcache's own dependencies (accelerate for
transformers' ``Trainer``, trl, datasets) comes with the ``train`` extra.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from shardcache.errors import MissingDependencyError

#: How to install every framework the integrations (and the recipes) use.
INSTALL = (
    'pip install "shardcache[train]" (in a clone of the repository: pip install -e ".[train]")'
)


def require(module: str, needed_by: str) -> ModuleType:
    """Import ``module``, or raise MissingDependencyError naming the ``train`` extra.

    Args:
        module: the module to import (``"trl"``, ``"accelerate"``, ...).
        needed_by: what needs it, for the message (``"ShardTrainer"``).

    Returns:
        The imported module.

    Raises:
        MissingDependencyError: ``module`` (or one of its own imports) is not installed.
    """
    try:
        return importlib.import_module(module)
    except ImportError as err:
        missing = getattr(err, "name", None) or module
        raise MissingDependencyError(
            f"{needed_by} needs {module}, which cannot be imported ({missing} is not installed: "
            f"{err}); install the train extra: {INSTALL}"
        ) from err
