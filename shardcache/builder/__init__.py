"""The build layer: corpus -> cache. Imports the store, never the readers.

Data flows ``sources`` (records) -> ``encoders`` (``tokenize`` for text, ``chat`` for
conversations; ``chunking`` for huge documents) -> ``partition`` (one partition's shard files,
bucketed by ``bucket``) -> ``commit`` (the manifest, last). ``plan`` cuts the inputs into
partitions and keeps the resume records; ``pool`` and ``engines`` schedule partitions (local
processes, Ray, job-array shares); ``run`` is the front door (``build_cache``, ``build``);
``remote`` stages builds from and into object storage; ``lock`` keeps one build per folder;
``keying`` computes the cache key of a configuration; ``report`` is what a build prints.
"""
