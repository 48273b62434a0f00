"""The store layer: the on-disk contract of a cache, shared by the builder and the readers.

It imports neither the builder nor the read layer, nor torch, tokenizers or transformers.
"""
