"""LoRA adapters in the worker: files loaded from the model bucket into a host-memory LRU, and adapter sets
activated per call on diffusers' own LoRA layers."""
