"""LoRA adapters on the worker's runner: the per-call cost of an adapter set against none, and the load time.

The tiny pipeline (the stack's tiny model directory) and its two tiny adapters, in this one process with
the worker's thread count. Per denoising call (one UNet call over a running set of `batch` images):
the base model, one adapter, two adapters, and a call that also switches sets (the hooks removed and
registered again). Load: an adapter read from the model bucket (the stack's GCS emulator), its digest
and targets checked and its tensors parsed, cold and from the host cache.

    .venv/bin/python -m bench.adapters --model-dir .stack/tiny-model/sd15-txt2img --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from contract.generation import AdapterRef
from contract.messages import GenerationParameters
from emulators.stack import local_catalog

MODEL = "sd15-txt2img"


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
            else:  # another set ran just before: the hooks are swapped in this timed call
                runner._lora.activate(switch_to)
            started = time.perf_counter()
            runner.denoise_step(running[name])
            times[name].append((time.perf_counter() - started) * 1000)
    return {name: statistics.median(values) for name, values in times.items()}


def main() -> None:
    import torch

    from contract import google_clients
    from contract.adapter_registry import AdapterRegistry
    from contract.settings import Settings
    from model_worker.adapters import AdapterLoader
    from model_worker.pipeline import DiffusionRunner
    from model_worker.runners import GenerationItem

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--threads", type=int, default=int(os.environ.get("MAAS_TORCH_THREADS", "1")))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    spec = local_catalog().get(MODEL).model_copy(update={"scheduling": "step"})
    settings = Settings.from_env()
    bucket = google_clients.storage_client(settings).bucket(settings.model_bucket)
    registry = AdapterRegistry(bucket)
    runner = DiffusionRunner(spec, args.model_dir, torch_threads=args.threads)
    runner.warm_up()

    loads = []
    refs = {}
    for name in ("tiny-ink", "tiny-neon"):
        record = registry.resolve(spec, name)
        refs[name] = AdapterRef(name=name, version=record.version, scale=0.8, sha256=record.sha256)
    loader = AdapterLoader(bucket, {MODEL: args.model_dir}, lambda: None)
    loader.start()
    sets = {}
    for name, ref in refs.items():
        for state in ("cold (bucket)", "cached (host memory)"):
            started = time.perf_counter()
            adapters = loader.request(spec, (ref,))
            adapters.done.wait(60)
            loads.append({"adapter": name, "state": state, "ms": (time.perf_counter() - started) * 1000,
                          "bytes": adapters.loaded[0][0].nbytes})  # fmt: skip
            sets[name] = adapters
    both = loader.request(spec, tuple(refs.values()))
    both.done.wait(60)
    loader.stop()

    params = GenerationParameters(seed=1, num_inference_steps=1000, guidance_scale=7.5, width=64, height=64)
    rows = []
    for batch in args.batches:

        def items(adapters, batch=batch):
            return [GenerationItem(f"bench {i}", i, adapters=adapters) for i in range(batch)]

        # "switched": the base set ran just before, as when an adapter request follows a base-model call.
        ms = per_call_ms(runner, {
            "base_ms": (items(None), None),
            "one_adapter_ms": (items(sets["tiny-ink"]), None),
            "two_adapters_ms": (items(both), None),
            "one_adapter_switching_ms": (items(sets["tiny-ink"]), []),
        }, params, args.calls)  # fmt: skip
        rows.append({"batch": batch, **ms})
    result = {"model": MODEL, "threads": args.threads, "size": 64, "rows": rows, "loads": loads,
              "accelerator": runner.accelerator}  # fmt: skip
    print(f"LoRA per denoising call on {runner.accelerator} (64x64, tiny UNet, {args.threads} thread(s)), median ms:")
    print("  batch | base | 1 adapter | 2 adapters | 1 adapter, set switched before each call")
    for r in rows:
        print(f"  {r['batch']:>5} | {r['base_ms']:.2f} | {r['one_adapter_ms']:.2f} ({r['one_adapter_ms'] / r['base_ms']:.2f}x)"
              f" | {r['two_adapters_ms']:.2f} ({r['two_adapters_ms'] / r['base_ms']:.2f}x)"
              f" | {r['one_adapter_switching_ms']:.2f} ({r['one_adapter_switching_ms'] / r['base_ms']:.2f}x)")  # fmt: skip
    print("Adapter load (download, digest, header and target checks, parse):")
    for load in loads:
        print(f"  {load['adapter']:<10} {load['state']:<22} {load['ms']:8.2f} ms ({load['bytes'] / 1e3:.0f} kB)")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
