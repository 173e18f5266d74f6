"""A predict request from its body to its answer: the body schema, the serving stages, dispatch to the
model queue, reply waiting, coalescing and the result cache, per-key limits and the adapters a request names."""
