"""The store layer: the on-disk contract of a cache, shared by the builder and the readers.

Folder layout and names (``layout``), atomic writes and sha256 (``files``), object storage
(``remote``), a build's output, a folder or a URL, with its lock (``storage``, ``build_lock``),
the manifest, Arrow shard files (``shards``), the read-side ``Cache``, the cache key and its
comparison (``key``, ``check``), ``verify`` and ``summary``. It imports neither the builder
nor the read layer, nor torch, tokenizers or transformers.
"""
