"""LoRA adapters on the worker's runner, per model family: the per-call cost of an adapter set against none, a
call that switches the set, and the cold load from the model bucket.

For each family's tiny pipeline (the stack's tiny model directories: SD 1.5, SDXL, FLUX.1 [schnell], SD 3.5) two
adapters built as `make up` builds its tiny ones (the attention projections of the denoiser and the text
encoders, diffusers' PEFT layout), uploaded to the model bucket (the stack's GCS emulator) and registered
as the admin call does (header checks against the base weights in the bucket), in this one process with the
worker's thread count. Per denoising call (one model call over a running set of `batch` images): the base
model, one adapter, two adapters, and one adapter with the base set run just before (the call switches the
set: diffusers' `set_adapters`). Load: an adapter read from the bucket (download, digest, header and target
checks, parse: the worker's loader), then its first activation on the device (diffusers' `load_lora_weights`).

    .venv/bin/python -m bench.adapters --model-root .stack/tiny-model --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from contract.generation import AdapterRef
from contract.messages import GenerationParameters
from emulators.stack import local_catalog

# One model per family the worker serves adapters for, as the local stack serves them.
MODELS = {"sd15": "sd15-txt2img", "sdxl": "sdxl-txt2img", "flux": "flux-schnell", "sd3": "sd35-txt2img"}
ADAPTERS = {"bench-ink": (1, 4), "bench-neon": (2, 8)}  # name -> (seed, rank), as `make up`'s tiny ones
SIZE = 64


def per_call_ms(runner, variants: dict, params, calls: int) -> dict[str, float]:
    """Median milliseconds of one denoising call per variant, the variants interleaved call by call so a
    machine's changing load falls on all of them alike. A variant: (items, set activated before the call)."""
    running = {name: runner.start_items(items, params) for name, (items, _) in variants.items()}
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(calls):
        for name, (items, switch_to) in variants.items():
            if all(r.finished for r in running[name]):
                running[name] = runner.start_items(items, params)
            if switch_to is None:  # steady state: an untimed call with this set first, so no switch is timed
                runner.denoise_step(running[name])
                if all(r.finished for r in running[name]):
                    running[name] = runner.start_items(items, params)
            else:  # another set ran just before: the set is switched in this timed call
                runner._lora.activate(switch_to)
            started = time.perf_counter()
            runner.denoise_step(running[name])
            times[name].append((time.perf_counter() - started) * 1000)
    return {name: statistics.median(values) for name, values in times.items()}


def publish(bucket, registry, spec, model_dir: Path, scratch: Path) -> dict[str, AdapterRef]:
    """Builds the bench adapters for the model, uploads and registers them; their refs at scale 0.8."""
    from contract import naming
    from emulators.tiny_pipeline import build_adapter

    refs = {}
    for name, (seed, rank) in ADAPTERS.items():
        file = build_adapter(model_dir, scratch / spec.name / f"{name}.safetensors", seed, rank)
        bucket.blob(naming.adapter_prefix(spec.name, name, "1") + naming.ADAPTER_FILE).upload_from_filename(file)
        record = registry.register(spec, name, "1")
        refs[name] = AdapterRef(name=name, version=record.version, scale=0.8, sha256=record.sha256)
    return refs


def bench_family(family: str, model_dir: Path, bucket, registry, args, scratch: Path) -> dict:
    from model_worker.adapters.loader import AdapterLoader
    from model_worker.model.pipeline import DiffusionRunner
    from model_worker.model.runners import GenerationItem

    catalog = local_catalog()
    policy = catalog.get("sd15-txt2img").adapters
    spec = catalog.get(MODELS[family]).model_copy(update={"scheduling": "step", "adapters": policy})
    refs = publish(bucket, registry, spec, model_dir, scratch)
    runner = DiffusionRunner(spec, model_dir, torch_threads=args.threads)
    runner.warm_up()
    loader = AdapterLoader(bucket, {spec.queue: model_dir}, lambda: None)
    loader.start()
    loads, sets = [], {}
    try:
        for name, ref in refs.items():
            started = time.perf_counter()
            adapters = loader.request(spec, (ref,))
            adapters.done.wait(60)
            bucket_ms = (time.perf_counter() - started) * 1000
            started = time.perf_counter()
            runner._lora.activate(adapters.weights())
            loads.append({"adapter": name, "bytes": adapters.loaded[0][0].nbytes, "bucket_ms": bucket_ms,
                          "device_ms": (time.perf_counter() - started) * 1000})  # fmt: skip
            sets[name] = adapters
        both = loader.request(spec, tuple(refs.values()))
        both.done.wait(60)
    finally:
        loader.stop()
    runner._lora.activate([])

    guidance = 0.0 if spec.guidance_mode == "none" else spec.defaults.guidance_scale
    # The model's most steps (a count its scheduler runs: contract/step_limits.py); a set that finishes is started
    # again between timed calls (`per_call_ms`), so the calls time a running set, never its start or decode.
    steps = spec.limits.max_inference_steps
    params = GenerationParameters(seed=1, num_inference_steps=steps, guidance_scale=guidance, width=SIZE, height=SIZE)
    rows = []
    for batch in args.batches:

        def items(adapters, batch=batch):
            return [GenerationItem(f"bench {i}", i, adapters=adapters) for i in range(batch)]

        ms = per_call_ms(runner, {
            "base_ms": (items(None), None),
            "one_adapter_ms": (items(sets["bench-ink"]), None),
            "two_adapters_ms": (items(both), None),
            "one_adapter_switching_ms": (items(sets["bench-ink"]), []),
        }, params, args.calls)  # fmt: skip
        rows.append({"batch": batch, **ms})
    return {"family": family, "model": spec.name, "rows": rows, "loads": loads, "accelerator": runner.accelerator}


def main() -> None:
    import torch

    from contract import google_clients
    from contract.settings import Settings
    from contract.stores.adapter_registry import AdapterRegistry

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-root", type=Path, required=True, help="the stack's tiny model directory")
    parser.add_argument("--families", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--threads", type=int, default=int(os.environ.get("MAAS_TORCH_THREADS", "1")))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    settings = Settings.from_env()
    bucket = google_clients.storage_client(settings).bucket(settings.model_bucket)
    registry = AdapterRegistry(bucket)
    with open("/proc/loadavg") as file:
        load_before = file.read().split()[:3]
    with tempfile.TemporaryDirectory() as scratch:
        results = [bench_family(family, args.model_root / MODELS[family], bucket, registry, args, Path(scratch))
                   for family in args.families]  # fmt: skip
    with open("/proc/loadavg") as file:
        load_after = file.read().split()[:3]
    accelerator = results[0]["accelerator"] if results else "?"
    print(f"LoRA per denoising call on {accelerator} ({SIZE}x{SIZE}, tiny models, {args.threads} thread(s)), median ms;"
          f" load average {' '.join(load_before)} before, {' '.join(load_after)} after:")  # fmt: skip
    print("  family | batch | base | 1 adapter | 2 adapters | 1 adapter, set switched before each call")
    for result in results:
        for r in result["rows"]:
            base = r["base_ms"]
            print(f"  {result['family']:<6} | {r['batch']:>5} | {base:.2f} | {r['one_adapter_ms']:.2f} "
                  f"({r['one_adapter_ms'] / base:.2f}x) | {r['two_adapters_ms']:.2f} ({r['two_adapters_ms'] / base:.2f}x)"
                  f" | {r['one_adapter_switching_ms']:.2f} ({r['one_adapter_switching_ms'] / base:.2f}x)")  # fmt: skip
    print(
        "Adapter load: cold from the bucket (download, digest, checks, parse), then onto the device (load_lora_weights):"
    )
    for result in results:
        for load in result["loads"]:
            print(f"  {result['family']:<6} {load['adapter']:<10} {load['bucket_ms']:8.2f} ms + {load['device_ms']:8.2f} ms"
                  f" ({load['bytes'] / 1e3:.0f} kB)")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps({"threads": args.threads, "size": SIZE, "families": results,
                                         "loadavg_before": load_before, "loadavg_after": load_after}, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
