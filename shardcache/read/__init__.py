"""The read layer: cache -> training batches.

The epoch plan and its split over ranks and workers (``plan``), batch arrays (``collate``,
``kernels``), attention keys of packed rows (``attention``), the resumable ``ShardDataset``
(``dataset``), the ``DevicePrefetcher`` (``prefetch``) and the one-call ``loader``. It imports
the store, never the builder: a reader process imports neither transformers nor tokenizers.
"""
