"""The builder layer: corpus -> cache, one pipeline. Imports the store, never the readers.

``run`` is the pipeline (plan, filter, map, commit); docs/architecture.md maps the modules.
"""
