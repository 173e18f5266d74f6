"""Flows in the worker: a flow request runs stage after stage, each an ordinary request to the pool, and
what is kept of each finished stage until the flow ends."""
