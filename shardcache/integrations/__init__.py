"""Framework glue above the read layer: training frameworks fed by shardcache.

``shardcache.integrations.hf``: transformers' ``Trainer`` (``ShardTrainer``), TRL's
``DPOTrainer`` on cached pairs, and losses of a causal LM computed a chunk of positions at a
time. The layer imports ``shardcache.read`` and the frameworks; nothing below it (``store``,
``builder``, ``read``) and not the ``shardcache`` facade imports it, so ``import shardcache``
and a reader process never load transformers or TRL. A missing framework is a
``MissingDependencyError`` that names the extra to install.
"""
