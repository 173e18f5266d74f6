"""Flows on the request path (called like a model, run stage after stage by the workers) and the rows a
flow leaves in the inference log."""
