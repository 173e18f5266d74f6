"""A model's weights in the model bucket: uploaded with their manifest, downloaded into a local cache checked
against it.

A weights prefix may carry `maas-manifest.json`: every file's size and SHA-256, written when the model was
uploaded. The worker checks each downloaded file against it before anything is loaded, so a missing, changed
or truncated file is never served: `WeightsIntegrityError` names the file and why (the worker's `/readyz` says
it, and it tries again). Every safetensors file is then checked against what the format requires
(`contract/safetensors_checks.py`: overlapping or stray tensor bytes would make diffusers fail at load):
`WeightsFormatError`, for an upload that matches its manifest and yet will never load (the worker waits for
another upload). A prefix without a manifest still loads, with a warning, so existing buckets work. Every file
lands inside the cache directory: a blob or manifest name that would lead out of it (`..`, an empty segment) is
refused.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path, PurePosixPath

from google.cloud import storage

from contract.safetensors_checks import SafetensorsError, is_pickle, read_file_header

log = logging.getLogger(__name__)
COMPLETE_MARKER = ".download-complete"
MANIFEST = "maas-manifest.json"
MANIFEST_FORMAT = 1
CHUNK = 8 * 1024 * 1024


class WeightsIntegrityError(Exception):
    """A weights file that does not match the manifest: never loaded."""

    def __init__(self, location: str, file: str, reason: str) -> None:
        super().__init__(f"{location}: {file}: {reason}")
        self.file, self.reason = file, reason


class WeightsFormatError(WeightsIntegrityError):
    """A file that matches the manifest but is not a safetensors file the format allows: it would not load, and the
    same upload never will (the worker waits for another rather than downloading it again)."""


def file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def build_manifest(directory: Path) -> dict:
    """Every file under `directory` (the manifest and the download marker aside): its size and SHA-256."""
    files = {
        path.relative_to(directory).as_posix(): {"size": path.stat().st_size, "sha256": file_digest(path)}
        for path in sorted(p for p in directory.rglob("*") if p.is_file() and p.name not in (MANIFEST, COMPLETE_MARKER))
    }
    return {"format": MANIFEST_FORMAT, "files": files}


def local_path(directory: Path, name: str, location: str) -> Path:
    """`directory / name` for a file name from the bucket (a blob's or the manifest's), refused unless it stays
    inside `directory`: relative, no `.` or `..` segment, no empty one, no backslash or NUL."""
    parts = name.split("/")
    if (
        not name
        or PurePosixPath(name).is_absolute()
        or any(part in ("", ".", "..") for part in parts)
        or "\\" in name
        or "\0" in name
    ):
        raise WeightsIntegrityError(location, repr(name), "a file name that leads out of the weights directory")
    path = directory / name
    if not path.resolve().is_relative_to(directory.resolve()):  # a symbolic link in the cache on the way
        raise WeightsIntegrityError(location, repr(name), "a file name that leads out of the weights directory")
    return path


def check_headers(directory: Path, location: str) -> None:
    """Every safetensors file under `directory` is one the format allows (what diffusers would fail to load, or
    load wrong, is refused here with the file and why: `WeightsFormatError`)."""
    for path in sorted(directory.rglob("*.safetensors")):
        try:
            read_file_header(path)
        except SafetensorsError as exc:
            raise WeightsFormatError(location, path.relative_to(directory).as_posix(), str(exc)) from exc


def verify(directory: Path, manifest: dict, location: str) -> None:
    """Raises `WeightsIntegrityError` for the first file missing, of another size, of another digest, or unlisted."""
    listed = manifest.get("files") or {}
    for name, expected in sorted(listed.items()):
        path = local_path(directory, name, location)
        if not path.is_file():
            raise WeightsIntegrityError(location, name, "missing (listed in the manifest)")
        size = path.stat().st_size
        if size != expected["size"]:
            raise WeightsIntegrityError(
                location, name, f"{size} bytes, the manifest says {expected['size']} (truncated?)"
            )
        digest = file_digest(path)
        if digest != expected["sha256"]:
            raise WeightsIntegrityError(
                location, name, f"sha256 {digest[:12]}…, the manifest says {expected['sha256'][:12]}… (changed)"
            )
    for path in directory.rglob("*"):
        name = path.relative_to(directory).as_posix()
        if path.is_file() and path.name not in (MANIFEST, COMPLETE_MARKER) and name not in listed:
            raise WeightsIntegrityError(location, name, "not in the manifest")


def _manifest(raw: bytes, location: str) -> dict:
    """A manifest as `build_manifest` writes it: {"files": {name: {"size": int, "sha256": str}}, ...}."""
    try:
        manifest = json.loads(raw)
        files = manifest.get("files") or {}
        sound = all(
            isinstance(entry, dict) and type(entry.get("size")) is int and isinstance(entry.get("sha256"), str)
            for entry in files.values()
        )
    except (ValueError, AttributeError, RecursionError):
        sound = False
    if not sound:
        raise WeightsIntegrityError(location, MANIFEST, "not a manifest (each file's size and sha256)")
    return manifest


def download_weights(client: storage.Client, bucket: str, prefix: str, cache_dir: Path) -> Path:
    """Returns the local directory, every file checked against the prefix's manifest when it has one.

    A previous download is reused only when it completed and was checked against the same manifest."""
    location = f"gs://{bucket}/{prefix.rstrip('/')}"
    target = local_path(cache_dir, prefix.rstrip("/"), location)
    prefix = prefix.rstrip("/") + "/"
    blobs = [blob for blob in client.list_blobs(bucket, prefix=prefix) if not blob.name.endswith("/")]
    if not blobs:
        raise FileNotFoundError(f"no weights under gs://{bucket}/{prefix}")
    manifest_blob = next((blob for blob in blobs if blob.name == prefix + MANIFEST), None)
    manifest = _manifest(manifest_blob.download_as_bytes(), location) if manifest_blob is not None else None
    stamp = hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest() if manifest else "unverified"
    marker = target / COMPLETE_MARKER
    if marker.exists() and marker.read_text() == stamp:
        log.info("weights already cached in %s", target)
        return target
    if manifest is None:
        log.warning("%s has no %s: loading its files unverified (upload with `python -m model_worker.weights "
                    "import` to record their digests)", location, MANIFEST)  # fmt: skip
    pickled = [blob.name[len(prefix) :] for blob in blobs if is_pickle(blob.name)]
    if pickled:
        raise WeightsIntegrityError(
            location, ", ".join(pickled), "pickle-format weights are refused (safetensors only)"
        )
    locals_ = {blob.name: local_path(target, blob.name[len(prefix) :], location) for blob in blobs}
    marker.unlink(missing_ok=True)
    total = 0
    for blob in blobs:
        if blob is manifest_blob:
            continue
        local = locals_[blob.name]
        local.parent.mkdir(parents=True, exist_ok=True)
        blob.download_to_filename(str(local))
        total += local.stat().st_size
    if manifest is not None:
        verify(target, manifest, location)
    check_headers(target, location)
    marker.write_text(stamp)
    log.info("downloaded %d files (%.1f MB) from %s%s", len(blobs), total / 1e6, location,
             ", each matching its manifest" if manifest else "")  # fmt: skip
    return target


def upload_with_manifest(
    client: storage.Client, local_dir: Path, bucket: str, prefix: str, origin: str | None = None
) -> dict:
    """Uploads every file of `local_dir` under `prefix`, then the manifest of their sizes and digests (last, so a
    reader never finds a manifest for files not yet there). `origin` is recorded in it (the local stack marks
    its tiny pipelines, so that it never uploads over an imported model)."""
    manifest = build_manifest(local_dir)
    if origin is not None:
        manifest["origin"] = origin
    target = client.bucket(bucket)
    for name in manifest["files"]:
        target.blob(f"{prefix.rstrip('/')}/{name}").upload_from_filename(str(local_dir / name))
    target.blob(f"{prefix.rstrip('/')}/{MANIFEST}").upload_from_string(
        json.dumps(manifest, indent=1, sort_keys=True), content_type="application/json"
    )
    return manifest
