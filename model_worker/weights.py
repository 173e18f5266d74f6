"""Downloads a model's weights prefix from the model bucket into a local cache directory."""

from __future__ import annotations

import logging
from pathlib import Path

from google.cloud import storage

log = logging.getLogger(__name__)
COMPLETE_MARKER = ".download-complete"


def download_weights(client: storage.Client, bucket: str, prefix: str, cache_dir: Path) -> Path:
    """Returns the local directory; skips the download when a previous one completed."""
    target = cache_dir / prefix
    if (target / COMPLETE_MARKER).exists():
        log.info("weights already cached in %s", target)
        return target
    prefix = prefix.rstrip("/") + "/"
    blobs = [blob for blob in client.list_blobs(bucket, prefix=prefix) if not blob.name.endswith("/")]
    if not blobs:
        raise FileNotFoundError(f"no weights under gs://{bucket}/{prefix}")
    pickled = [blob.name for blob in blobs if blob.name.endswith((".bin", ".pt", ".pth", ".ckpt", ".pkl"))]
    if pickled:
        raise ValueError(f"refusing pickle-format weights (use safetensors): {pickled}")
    total = 0
    for blob in blobs:
        local = target / blob.name[len(prefix) :]
        local.parent.mkdir(parents=True, exist_ok=True)
        blob.download_to_filename(str(local))
        total += local.stat().st_size
    (target / COMPLETE_MARKER).write_text("ok")
    log.info("downloaded %d files (%.1f MB) from gs://%s/%s", len(blobs), total / 1e6, bucket, prefix)
    return target
