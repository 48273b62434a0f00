"""The store layer: the on-disk contract of a cache, shared by the builder and the readers.

It owns the folder layout and the one place a manifest name becomes a path
(:mod:`~shardcache.store.layout`), atomic writes and the streaming sha256
(:mod:`~shardcache.store.files`), object storage through fsspec (:mod:`~shardcache.store.remote`),
the manifest (:mod:`~shardcache.store.manifest`), Arrow shard files
(:mod:`~shardcache.store.shards`), the read-side :class:`~shardcache.store.cache.Cache` with its
shard LRU, the cache key and lock files (:mod:`~shardcache.store.key`), key comparison
(:mod:`~shardcache.store.check`), ``verify`` and ``info`` summaries.

Rules: nothing here imports :mod:`shardcache.builder` or :mod:`shardcache.read`, nor torch,
tokenizers or transformers (a test walks the import graph).
"""
