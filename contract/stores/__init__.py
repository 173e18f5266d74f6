"""The Redis and bucket stores both services read and write (requests in flight, results, the adapter registry).

The rest of `contract` is the wire format: messages, names, the catalog, settings. These modules hold state and
threads, so they live apart from it, here; they stay inside `contract` because the API and the worker share
nothing else (the layering contracts in pyproject.toml).
"""
