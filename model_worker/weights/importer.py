"""Imports a model into the model bucket: checks it, uploads it with its manifest, gives its catalog version.

    python -m model_worker.weights import SOURCE --model NAME --version V [--family F] [--base BASE]

(the command line: `model_worker/weights/cli.py`). SOURCE is a diffusers folder (`model_index.json` and its
components) or a single-file `.safetensors` checkpoint (SD 1.5, SDXL, FLUX.1, or a Z-Image or Qwen-Image
transformer), converted first against BASE
(`model_worker/weights/checkpoints.py`): a diffusers folder of the same family, local or `gs://bucket/prefix` (an
already-served model, downloaded checked against its manifest), which gives the configuration, tokenizers and the
components the file lacks. Nothing is executed or unpickled: every weight file must be safetensors with a header
the format allows (`contract/safetensors_checks.py`: a pickle renamed `.safetensors`, a truncated file, tensors
that overlap or leave bytes unaccounted for are refused), and the pipeline class it names must be one the catalog
serves. MODEL and VERSION must be names the catalog takes (`contract/naming.py`). The files go to
`gs://{bucket}/{model}/{version}/` followed by `maas-manifest.json` (each file's size and SHA-256), which the
worker checks every download against.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

from contract import naming
from contract.families import PIPELINES, family_of
from contract.safetensors_checks import SafetensorsError, is_pickle, read_file_header
from model_worker.weights.checkpoints import CheckpointRefusedError, convert_checkpoint, pipeline_class
from model_worker.weights.store import WeightsIntegrityError, download_weights, upload_with_manifest

# Weights in formats the worker never loads: refused in a diffusers folder (pickles too: `is_pickle`).
FOREIGN_SUFFIXES = (".onnx", ".msgpack")


class ImportRefusedError(ValueError):
    """The source cannot be imported; the message says which file and why."""


@dataclass(frozen=True)
class CheckedModel:
    directory: Path
    pipeline: str
    family: str
    task: str
    files: int
    weight_bytes: int


def check_folder(source: Path, family: str | None = None) -> CheckedModel:
    """A diffusers folder the worker can load: a served pipeline class, safetensors weights only, sound headers."""
    if source.is_file():
        raise ImportRefusedError(f"{source}: a single-file checkpoint; import it with --base (a diffusers folder "
                                 "or gs:// weights path of the same family) to convert it")  # fmt: skip
    index = source / "model_index.json"
    if not index.is_file():
        raise ImportRefusedError(f"{source}: no model_index.json (not a diffusers folder)")
    try:
        pipeline = pipeline_class(index)
    except CheckpointRefusedError as exc:
        raise ImportRefusedError(str(exc)) from exc
    found = family_of(pipeline)
    if found is None:
        raise ImportRefusedError(f"{index}: pipeline {pipeline!r} is not served; one of {', '.join(sorted(PIPELINES))}")
    if family is not None and family != found.name:
        raise ImportRefusedError(f"{source}: --family {family}, but its pipeline {pipeline} is a {found.name} model")
    weight_bytes, files = 0, 0
    for path in sorted(p for p in source.rglob("*") if p.is_file()):
        files += 1
        if is_pickle(path.name) or path.suffix.lower() in FOREIGN_SUFFIXES:
            raise ImportRefusedError(
                f"{path.relative_to(source)}: not safetensors (pickled or foreign weights are refused)"
            )
        if path.suffix == ".safetensors":
            check_safetensors(path, source)
            weight_bytes += path.stat().st_size
    if weight_bytes == 0:
        raise ImportRefusedError(f"{source}: no safetensors weights")
    return CheckedModel(source, pipeline, found.name, found.pipelines[pipeline], files, weight_bytes)


def check_safetensors(path: Path, root: Path) -> None:
    """The header is one the safetensors format allows (a pickle, a truncated file, overlapping tensors fail)."""
    try:
        read_file_header(path)
    except SafetensorsError as exc:
        raise ImportRefusedError(f"{path.relative_to(root)}: {exc}") from exc


def catalog_entry(model: str, version: str, checked: CheckedModel, origin: str = "") -> str:
    """The catalog lines for the new version, at 0% of the traffic until a canary is set."""
    return (
        f"# {model} version {version}: {checked.pipeline} ({checked.family}), {checked.files} files, "
        f"{checked.weight_bytes / 1e6:.1f} MB of weights{origin}\n"
        f"  {model}:\n"
        f"    versions:\n"
        f'      "{version}": {{weights_path: {model}/{version}, pipeline: {checked.pipeline}}}\n'
        f"    traffic: {{...}}   # unchanged: the new version takes 0% until PUT /v1/models/{model}/traffic\n"
    )


def check_names(model: str, version: str) -> None:
    """`model` and `version` are names the catalog takes (ImportRefusedError says which is not, and why)."""
    for problem in (naming.model_name_problem(model), naming.version_name_problem(version)):
        if problem is not None:
            raise ImportRefusedError(problem)


def import_model(
    client, bucket: str, source: Path, model: str, version: str, family: str | None = None, base: str | None = None
) -> str:
    """Checks (a single file: converts against `base` first) and uploads; returns the catalog entry to add."""
    check_names(model, version)
    if not source.is_file() or base is None:
        checked = check_folder(source, family)
        upload_with_manifest(client, source, bucket, f"{model}/{version}")
        return catalog_entry(model, version, checked)
    with tempfile.TemporaryDirectory(prefix="maas-import-") as work:
        folder, origin = convert_single_file(client, source, base, Path(work), family)
        checked = check_folder(folder, family)
        upload_with_manifest(client, folder, bucket, f"{model}/{version}")
    return catalog_entry(model, version, checked, origin)


def convert_single_file(client, source: Path, base: str, work: Path, family: str | None) -> tuple[Path, str]:
    """The diffusers folder converted from `source` against `base` (a folder, or gs://bucket/prefix downloaded
    and checked against its manifest), and a note of what came from where for the catalog comment."""
    if base.startswith("gs://"):
        bucket_name, _, prefix = base.removeprefix("gs://").partition("/")
        try:
            base_dir = download_weights(client, bucket_name, prefix.rstrip("/"), work / "base")
        except (FileNotFoundError, WeightsIntegrityError, ValueError) as exc:
            raise ImportRefusedError(f"base {base}: {exc}") from exc
    else:
        base_dir = Path(base)
        if not base_dir.is_dir():
            raise ImportRefusedError(f"base {base}: not a directory or gs:// weights path")
    try:
        found, from_base, notes = convert_checkpoint(source, base_dir, work / "converted", family)
    except CheckpointRefusedError as exc:
        raise ImportRefusedError(str(exc)) from exc
    return (
        work / "converted",
        f"\n# converted from {source.name} ({found}); from the base {base}: {', '.join(from_base)}"
        + "".join(f"\n# {note}" for note in notes),
    )
