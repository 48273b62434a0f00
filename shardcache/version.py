"""The package version (its own module so that submodules can import it early)."""

from __future__ import annotations

__version__ = "0.1.0"
