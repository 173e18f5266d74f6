"""Imports a model into the model bucket: checks it, uploads it with its manifest, prints its catalog version.

    python -m model_worker.weights import SOURCE --model NAME --version V [--family F] [--base BASE]

SOURCE is a diffusers folder (`model_index.json` and its components) or a single-file `.safetensors` checkpoint
(SD 1.5, SDXL or FLUX.1), converted first against BASE (`model_worker/checkpoints.py`): a diffusers folder of
the same family, local or `gs://bucket/prefix` (an already-served model, downloaded checked against its
manifest), which gives the configuration, tokenizers and the components the file lacks. Nothing is executed or
unpickled:
every weight file must be safetensors with a sound header (a pickle renamed `.safetensors`, or a truncated
file, is refused), and the pipeline class it names must be one the catalog serves. The files go to
`gs://{bucket}/{model}/{version}/` followed by `maas-manifest.json` (each file's size and SHA-256), which the
worker checks every download against.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

from contract.families import PIPELINES, family_of
from contract.lora_files import PICKLE_SUFFIXES, AdapterFileError, read_file_header

# Weight files a diffusers folder may hold; anything else with these suffixes is refused.
WEIGHT_SUFFIXES = (".safetensors", *PICKLE_SUFFIXES, ".onnx", ".msgpack")


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
        pipeline = json.loads(index.read_text())["_class_name"]
    except (ValueError, KeyError) as exc:
        raise ImportRefusedError(f"{index}: unreadable ({exc})") from exc
    found = family_of(pipeline)
    if found is None:
        raise ImportRefusedError(f"{index}: pipeline {pipeline!r} is not served; one of {', '.join(sorted(PIPELINES))}")
    if family is not None and family != found.name:
        raise ImportRefusedError(f"{source}: --family {family}, but its pipeline {pipeline} is a {found.name} model")
    weight_bytes, files = 0, 0
    for path in sorted(p for p in source.rglob("*") if p.is_file()):
        files += 1
        if path.suffix in PICKLE_SUFFIXES or path.suffix in (".onnx", ".msgpack"):
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
    """The header parses and every tensor's bytes lie inside the file (a pickle or a truncated file fails)."""
    try:
        read_file_header(path)
    except AdapterFileError as exc:
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


def import_model(
    client, bucket: str, source: Path, model: str, version: str, family: str | None = None, base: str | None = None
) -> str:
    """Checks (a single file: converts against `base` first) and uploads; returns the catalog entry to add."""
    from model_worker.weights import upload_with_manifest

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
    from model_worker.checkpoints import CheckpointRefusedError, convert_checkpoint
    from model_worker.weights import WeightsIntegrityError, download_weights

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
