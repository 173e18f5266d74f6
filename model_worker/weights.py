"""Downloads a model's weights prefix from the model bucket into a local cache directory, checked against its manifest.

A weights prefix may carry `maas-manifest.json`: every file's size and SHA-256, written when the model was
uploaded. The worker checks each downloaded file against it before anything is loaded, so a missing, changed
or truncated file is never served: `WeightsIntegrityError` names the file and why (the worker's `/readyz` says
it, and it tries again). A prefix without a manifest still loads, with a warning, so existing buckets work.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

from google.cloud import storage

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


def verify(directory: Path, manifest: dict, location: str) -> None:
    """Raises `WeightsIntegrityError` for the first file missing, of another size, of another digest, or unlisted."""
    listed = manifest.get("files") or {}
    for name, expected in sorted(listed.items()):
        path = directory / name
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


def download_weights(client: storage.Client, bucket: str, prefix: str, cache_dir: Path) -> Path:
    """Returns the local directory, every file checked against the prefix's manifest when it has one.

    A previous download is reused only when it completed and was checked against the same manifest."""
    target = cache_dir / prefix
    location = f"gs://{bucket}/{prefix.rstrip('/')}"
    prefix = prefix.rstrip("/") + "/"
    blobs = [blob for blob in client.list_blobs(bucket, prefix=prefix) if not blob.name.endswith("/")]
    if not blobs:
        raise FileNotFoundError(f"no weights under gs://{bucket}/{prefix}")
    manifest_blob = next((blob for blob in blobs if blob.name == prefix + MANIFEST), None)
    manifest = json.loads(manifest_blob.download_as_bytes()) if manifest_blob is not None else None
    stamp = hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest() if manifest else "unverified"
    marker = target / COMPLETE_MARKER
    if marker.exists() and marker.read_text() == stamp:
        log.info("weights already cached in %s", target)
        return target
    if manifest is None:
        log.warning("%s has no %s: loading its files unverified (upload with `python -m model_worker.weights "
                    "import` to record their digests)", location, MANIFEST)  # fmt: skip
    pickled = [blob.name for blob in blobs if blob.name.endswith((".bin", ".pt", ".pth", ".ckpt", ".pkl"))]
    if pickled:
        raise ValueError(f"refusing pickle-format weights (use safetensors): {pickled}")
    marker.unlink(missing_ok=True)
    total = 0
    for blob in blobs:
        if blob is manifest_blob:
            continue
        local = target / blob.name[len(prefix) :]
        local.parent.mkdir(parents=True, exist_ok=True)
        blob.download_to_filename(str(local))
        total += local.stat().st_size
    if manifest is not None:
        verify(target, manifest, location)
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


def main(argv: list[str] | None = None) -> int:
    """`python -m model_worker.weights import SOURCE --model NAME --version V`: see `model_worker/importer.py`."""
    import argparse
    import os
    import sys

    from contract import google_clients
    from contract.settings import Settings, local_stack_environment
    from model_worker.importer import ImportRefusedError, import_model

    parser = argparse.ArgumentParser(prog="python -m model_worker.weights", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    importing = commands.add_parser("import", help="check a model (converted first if a single file) and upload it "
                                    "with its manifest")  # fmt: skip
    importing.add_argument("source", type=Path, help="a diffusers folder, or a single-file .safetensors checkpoint "
                           "(SD 1.5, SDXL, FLUX.1) with --base")  # fmt: skip
    importing.add_argument("--model", required=True)
    importing.add_argument("--version", required=True)
    importing.add_argument("--family", help="refuse the source unless it is of this family (sd15, sdxl, flux, sd3)")
    importing.add_argument("--base", help="for a single file: the diffusers folder, or gs://bucket/prefix of a served "
                           "model, of the same family, giving configs, tokenizers and the components the file lacks")  # fmt: skip
    importing.add_argument("--bucket", help="the model bucket (default: the settings' MAAS_MODEL_BUCKET)")
    importing.add_argument("--stack", type=Path, help="a local stack directory (.stack): import into its GCS emulator")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a conversion reads the base's files only, never the Hub
    if args.stack is not None:
        try:
            os.environ.update(local_stack_environment(args.stack))
        except FileNotFoundError as exc:
            parser.error(str(exc))
    settings = Settings.from_env()
    try:
        client = google_clients.storage_client(settings)
        entry = import_model(client, args.bucket or settings.model_bucket, args.source, args.model, args.version,
                             args.family, args.base)  # fmt: skip
    except ImportRefusedError as exc:
        print(f"refused: {exc}", file=sys.stderr)
        return 2
    print(f"uploaded to gs://{args.bucket or settings.model_bucket}/{args.model}/{args.version}/ with {MANIFEST}")
    print(entry)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
