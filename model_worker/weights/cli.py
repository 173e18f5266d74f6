"""`python -m model_worker.weights import SOURCE --model NAME --version V`: imports a model into the model bucket
(`model_worker/weights/importer.py`). Exits 0 with the catalog lines to add; 2 with `refused: FILE: why` for a
source that cannot be served (a malformed safetensors header included), or for a model or version name the
catalog would not take; never with a traceback for what a file holds."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path

from contract import google_clients, naming
from contract.families import FAMILIES
from contract.settings import Settings, local_stack_environment
from model_worker.weights.importer import ImportRefusedError, import_model
from model_worker.weights.store import MANIFEST


def _name(problem: Callable[[str], str | None]) -> Callable[[str], str]:
    """An argparse type: the value itself, or the catalog's reason it is not a name."""

    def check(value: str) -> str:
        if (reason := problem(value)) is not None:
            raise argparse.ArgumentTypeError(reason)
        return value

    return check


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m model_worker.weights", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    importing = commands.add_parser("import", help="check a model (converted first if a single file) and upload it "
                                    "with its manifest")  # fmt: skip
    importing.add_argument("source", type=Path, help="a diffusers folder, or a single-file .safetensors checkpoint "
                           "(SD 1.5, SDXL, FLUX.1; a Z-Image or Qwen-Image transformer) with --base")  # fmt: skip
    importing.add_argument("--model", required=True, type=_name(naming.model_name_problem),
                           help="the catalog model it is a version of")  # fmt: skip
    importing.add_argument("--version", required=True, type=_name(naming.version_name_problem),
                           help="its catalog version (lowercase letters, digits and '-')")  # fmt: skip
    importing.add_argument("--family", help=f"refuse the source unless it is of this family ({', '.join(FAMILIES)})")
    importing.add_argument("--base", help="for a single file: the diffusers folder, or gs://bucket/prefix of a served "
                           "model, of the same family, giving configs, tokenizers and the components the file lacks")  # fmt: skip
    importing.add_argument("--bucket", help="the model bucket (default: the settings' MAAS_MODEL_BUCKET)")
    importing.add_argument("--stack", type=Path, help="a local stack directory (.stack): import into its GCS emulator")
    return parser


def main(argv: list[str] | None = None) -> int:
    arguments = parser()
    args = arguments.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a conversion reads the base's files only, never the Hub
    if args.stack is not None:
        try:
            os.environ.update(local_stack_environment(args.stack))
        except FileNotFoundError as exc:
            arguments.error(str(exc))
    settings = Settings.from_env()
    bucket = args.bucket or settings.model_bucket
    try:
        client = google_clients.storage_client(settings)
        entry = import_model(client, bucket, args.source, args.model, args.version, args.family, args.base)
    except ImportRefusedError as exc:
        print(f"refused: {exc}", file=sys.stderr)
        return 2
    print(f"uploaded to gs://{bucket}/{args.model}/{args.version}/ with {MANIFEST}")
    print(entry)
    return 0
