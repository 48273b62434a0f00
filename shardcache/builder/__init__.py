"""The builder layer: corpus -> cache, one pipeline. Imports the store, never the readers.

``run`` is the pipeline (plan -> map -> commit, :func:`~shardcache.builder.run.build`):
``build_plan`` cuts the inputs into partitions, records the plan in the output and finds the
completed partitions (resume), a job-array ``Share`` filters them; ``engines`` / ``pool`` map
them (in-process, a process pool, Ray) with ``partition`` (records from ``sources`` ->
``encoders``: ``tokenize`` for text, ``chat`` for conversations, ``chunking`` for huge
documents -> shard files bucketed by ``bucket``); ``commit`` joins them (``compact``) and
writes the manifest last. The output is a :mod:`shardcache.store.storage` (a folder or a URL).
``backends`` and ``backend_gate`` choose the encoder backend; ``tokenizer_memo`` remembers what
transformers resolved from a tokenizer folder; ``key_computation`` computes the cache key of a
configuration; ``token_audit`` re-tokenizes a cache's documents (``verify --tokens``);
``fault_points`` is the seam of the crash tests; ``report`` is what a build prints.
"""
