"""The model: the runner interface, the diffusers runner and its families (one denoiser each), compile,
quantization at load, and the check of a unit's memory plan against the real device."""
