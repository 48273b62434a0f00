"""``python -m shardcache``: the same command line as the ``shardcache`` script."""

from __future__ import annotations

from shardcache.cli import main

if __name__ == "__main__":
    main(prog_name="shardcache")
