"""A model's weights, in one room with one-way imports (kept by the `weights-one-way` contract in pyproject.toml):

- `store`: the model bucket's weights prefixes, uploaded with their manifest and downloaded checked against it
  (what the worker loads);
- `checkpoints`: a single-file checkpoint converted into a diffusers folder against a base;
- `importer`: a folder or a single file checked (converted first), uploaded, its catalog version given; it uses
  the two above;
- `cli` (`python -m model_worker.weights import ...`, `make import-model`): the command line of the import.

Every safetensors file in them is checked by `contract/safetensors_checks.py`, as adapters are.
"""
