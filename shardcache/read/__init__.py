"""The read layer: cache -> training batches (plan, collate/kernels, dataset, prefetch, loader).

It imports the store, never the builder: a reader process imports neither transformers nor
tokenizers.
"""
