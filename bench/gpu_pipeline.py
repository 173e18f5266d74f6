"""SD-1.5-sized random-weight pipeline on a CUDA GPU: the direct pipeline beside the worker's runner, eager and compiled.

Builds the pipeline from configuration (no download): UNet 320/640/1280/1280 with cross-attention 768 and
attention head dim 8, VAE 128/256/512/512, a 12-layer 768-wide CLIP text encoder with 12 heads, random
weights scaled by 0.5 so fp16 activations stay finite, saved once as fp16 safetensors. Then, at 512x512,
25 steps, fp16:

- direct: the diffusers pipeline called back to back at batch 1, 4, 8, 16;
- worker: the worker's `DiffusionRunner` behind its own pool, device loop and finisher (PNG encode,
  result store, publish: in memory, no emulators), fed a stream of single-image requests;
- open-loop: `open_loop.py`'s Poisson sweep on this pipeline, request-level against step-level scheduling
  (half 12-step, half 25-step requests), in process around the worker's stages;
- compiled: the same with `MAAS_TORCH_COMPILE`'s path (channels-last, torch.compile at the batch buckets, the
  catalog's adapter slots made before compiling: rank `max_rank` on every Linear and Conv2d layer), its
  artifacts saved; then, on that compiled model, adapters through the worker's loader (a local bucket):
  a base call, one adapter, a switch to another, two at once and the base model again, each call timed
  (the first of a set includes its hotswap) with the graphs torch compiled after the warm-up counted (the
  target: none);
- compiled-plain: the model compiled without adapter slots (the catalog entry less its `adapters` block, so
  the q/k/v projections fused), the direct rate only: against `compiled`'s, what the empty slots cost;
- warm-start: a fresh process with only the saved artifacts (an empty inductor cache) is timed from its start
  to its first answered request.

    .venv/bin/python -m bench.gpu_pipeline                         # every stage
    .venv/bin/python -m bench.gpu_pipeline --stages direct worker  # eager only (compiling takes minutes)

`--quantization TYPE...` runs `quantized_pipeline.py`'s comparison instead of the stages above: the worker's
runner in the serving dtype and quantized at load as each TYPE (the catalog's: float8_weight_only, float8_dynamic,
int8_weight_only), eager (`direct` or `worker` among `--stages`) and compiled (`compiled`), one image per call:
s/image, and GB allocated once loaded and at the peak. `--family flux` is FLUX.1 [schnell] at its real size
(random weights, about 34 GB of bf16 safetensors built once under `--workdir`), at `--size 1024`:

    .venv/bin/python -m bench.gpu_pipeline --family flux --size 1024 --stages direct compiled \
        --quantization float8_weight_only float8_dynamic int8_weight_only
    .venv/bin/python -m bench.gpu_pipeline --family flux --tiny --size 64 --quantization int8_weight_only  # CPU

Needs only PyTorch with CUDA and the worker's packages. Without a GPU it says so and exits 0 (`--tiny` runs the
quantization comparison on the local stack's tiny pipeline on a CPU: the smoke test; times only, no memory).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import get_args

from bench.gpu_models import LocalBucket, build_sd15_sized
from contract.quantization import QuantizationType

ROOT = Path(__file__).resolve().parent.parent
STAGES = ("direct", "worker", "open-loop", "compiled", "compiled-plain", "warm-start")
# The compiled model's adapters: name -> (seed, rank), diffusers' PEFT layout on the UNet's attention projections.
COMPILED_ADAPTERS = {"bench-ink": (1, 16), "bench-neon": (2, 64)}
# The open-loop sweep's step mix on the GPU: the catalog's default 25 and a shorter request beside it.
GPU_STEP_MIX = (12, 25)
DEFAULT_STEPS = 25
# The catalog's quantization types, for `--quantization`.
QUANTIZATION_TYPES = get_args(QuantizationType)


def sd15_spec():
    """The production catalog's entry (its defaults size the compiled warm-up), not the local stack's small ones."""
    from contract.catalog import load_catalog

    return load_catalog().get("sd15-txt2img")


def generation_parameters(spec, steps: int, size: int):
    from contract.messages import GenerationParameters

    return GenerationParameters(
        seed=0, num_inference_steps=steps, guidance_scale=spec.defaults.guidance_scale, width=size, height=size
    )


def direct_rate(pipeline, batch: int, params, seconds: float, min_calls: int = 2) -> float:
    """Images/s of back-to-back pipeline calls (after one warm-up call), timed with the GPU synchronized."""
    import torch

    def call(seed: int) -> None:
        with torch.inference_mode():
            pipeline(
                prompt=[f"bench {seed + i}" for i in range(batch)],
                num_inference_steps=params.num_inference_steps,
                guidance_scale=params.guidance_scale,
                width=params.width,
                height=params.height,
                generator=[torch.Generator(device="cpu").manual_seed(seed + i) for i in range(batch)],
            )

    call(0)
    torch.cuda.synchronize()
    calls, started = 0, time.perf_counter()
    while calls < min_calls or time.perf_counter() - started < seconds:
        call(calls * batch)
        calls += 1
    torch.cuda.synchronize()
    return calls * batch / (time.perf_counter() - started)


def worker_rate(runner, spec, params, seconds_hint: float, direct_guess: float | None) -> dict:
    from bench.worker_harness import worker_images_per_second

    batch = spec.max_batch_size
    images = max(3 * batch, int(seconds_hint * (direct_guess or 2.0)) // batch * batch)
    return worker_images_per_second(runner, spec, params, batch, images=images, warmup_images=batch)


def compile_cache(workdir: Path, spec):
    from contract import naming
    from model_worker.model.compiled import CompileCache, compile_cache_key

    name = naming.compile_cache_object(spec.weights_path, compile_cache_key(spec))
    return CompileCache(LocalBucket(workdir / "compile-cache"), name)


def graphs_compiled() -> int:
    """Graphs torch.compile has made in this process (a recompile is one more)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def serve(runner, spec, items: list, params) -> list:
    """The items through the runner as the worker runs the model's scheduling (what its warm-up compiled)."""
    if spec.scheduling != "step":
        return runner.generate(items, params, lambda step, total: None)
    running = runner.start_items(items, params)
    while not all(r.finished for r in running):
        runner.denoise_step(running)
    return runner.decode(running)


def compiled_adapters(
    runner, spec, weights: Path, workdir: Path, params, calls: int = 3, ranks: dict | None = None
) -> dict:
    """On a compiled, warmed-up runner: adapter sets through the worker's loader, a request of `max_batch_size` images
    per set in the model's scheduling, timed (the first call of a set includes its hotswap; then the median of `calls`), with the graphs
    compiled since the warm-up counted after each set. `ranks`: name -> (seed, rank), COMPILED_ADAPTERS by default
    (a tiny model takes smaller ranks); on a CPU nothing is synchronized."""
    import hashlib

    import torch
    from safetensors.torch import load_file, save

    from contract import naming
    from contract.generation import AdapterRef
    from emulators.tiny_pipeline import build_adapter
    from model_worker.adapters.loader import AdapterLoader
    from model_worker.model.runners import GenerationItem

    def sync() -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    bucket = LocalBucket(workdir / "adapter-bucket")
    refs = {}
    for name, (seed, rank) in (ranks or COMPILED_ADAPTERS).items():
        built = build_adapter(weights, workdir / "adapters" / f"{name}.safetensors", seed, rank)
        # The UNet's part: a compiled model refuses text-encoder layers.
        data = save({k: v for k, v in load_file(built).items() if k.startswith("unet.")})
        bucket.blob(naming.adapter_prefix(spec.name, name, "1") + naming.ADAPTER_FILE).upload_from_string(data)
        refs[name] = AdapterRef(name=name, version="1", scale=0.8, sha256=hashlib.sha256(data).hexdigest())
    loader = AdapterLoader(bucket, {spec.queue: weights}, lambda: None)
    loader.start()
    sets = {"base": None}
    try:
        for label, chosen in (("bench-ink", ("bench-ink",)), ("bench-neon", ("bench-neon",)),
                              ("both", ("bench-ink", "bench-neon"))):  # fmt: skip
            adapters = loader.request(spec, tuple(refs[name] for name in chosen))
            adapters.done.wait(120)
            adapters.weights()  # raises when the loader refused a file
            sets[label] = adapters
    finally:
        loader.stop()
    before = graphs_compiled()
    rows = []
    for label in ("base", "bench-ink", "bench-neon", "both", "base"):
        items = [GenerationItem(f"bench {i}", i, adapters=sets[label]) for i in range(spec.max_batch_size)]
        times = []
        for _ in range(1 + calls):
            sync()
            started = time.perf_counter()
            serve(runner, spec, items, params)
            sync()
            times.append(time.perf_counter() - started)
        later = statistics.median(times[1:]) if calls else float("nan")
        rows.append({"set": label, "first_call_s": times[0], "median_call_s": later,
                     "graphs_compiled_since_warm_up": graphs_compiled() - before})  # fmt: skip
        print(f"compiled, adapters {label}: first call {times[0]:.2f}s (with its swap), then "
              f"{later:.2f}s; graphs compiled since the warm-up: {rows[-1]['graphs_compiled_since_warm_up']}",
              flush=True)  # fmt: skip
    return {"batch": spec.max_batch_size, "rows": rows, "recompiles": graphs_compiled() - before}


def warm_start_child(weights: Path, workdir: Path, launched: float, steps: int, size: int) -> None:
    """In a fresh process: load, compile from saved artifacts only, warm up, answer one request."""
    from model_worker.model.pipeline import DiffusionRunner
    from model_worker.model.runners import GenerationItem

    spec = sd15_spec()
    runner = DiffusionRunner(spec, weights, compile_unet=True, compile_cache=compile_cache(workdir, spec))
    runner.warm_up()
    runner.generate(
        [GenerationItem(prompt="first", seed=1)], generation_parameters(spec, steps, size), lambda s, t: None
    )
    print(json.dumps({"first_request_s": time.time() - launched}), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", nargs="+", choices=STAGES, default=list(STAGES))
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="(--quantization: the catalog's default)")
    parser.add_argument("--size", type=int, default=512)
    parser.add_argument("--seconds", type=float, default=15.0, help="measurement time per point")
    parser.add_argument("--workdir", type=Path, default=ROOT / ".gpu-bench", help="weights and compile artifacts")
    parser.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "gpu_pipeline.json")
    parser.add_argument("--warm-start-child", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--family", choices=("sd15", "flux"), default="sd15",
                        help="--quantization's pipeline (the other stages are SD-1.5-sized only)")  # fmt: skip
    parser.add_argument("--quantization", nargs="+", choices=QUANTIZATION_TYPES,
                        help="compare the serving dtype with these quantizations at load (see above)")  # fmt: skip
    parser.add_argument("--tiny", action="store_true", help="--quantization on the tiny pipeline (runs on a CPU)")
    parser.add_argument("--calls", type=int, default=3, help="--quantization: timed calls per variant")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import torch

    if args.quantization and (args.tiny or torch.cuda.is_available()):
        return quantization_comparison(args)
    if not torch.cuda.is_available():
        print(
            f"No CUDA GPU here (torch {torch.__version__}, CUDA available: no): nothing measured. "
            "bench/gpu_pipeline.py builds an SD-1.5-sized fp16 pipeline and needs an NVIDIA GPU; run it there."
        )
        return 0
    weights = args.workdir / "sd15-sized"
    if args.warm_start_child is not None:
        warm_start_child(weights, args.workdir, args.warm_start_child, args.steps, args.size)
        return 0

    import diffusers

    from model_worker.model.pipeline import DiffusionRunner

    device = torch.cuda.get_device_name(0)
    print(f"{device}, torch {torch.__version__}, diffusers {diffusers.__version__}", flush=True)
    started = time.perf_counter()
    build_sd15_sized(weights)
    print(f"pipeline ready in {weights} ({time.perf_counter() - started:.0f}s)", flush=True)
    spec = sd15_spec()
    params = generation_parameters(spec, args.steps, args.size)
    result: dict = {"device": device, "torch": torch.__version__, "steps": args.steps, "size": args.size}
    if args.json.exists():
        result = {**json.loads(args.json.read_text()), **result}  # stages run in separate calls add up

    if "direct" in args.stages:
        pipeline = diffusers.StableDiffusionPipeline.from_pretrained(
            weights, torch_dtype=torch.float16, use_safetensors=True, safety_checker=None,
            requires_safety_checker=False,
        ).to("cuda")  # fmt: skip
        pipeline.set_progress_bar_config(disable=True)
        result["direct"] = {}
        for batch in args.batches:
            rate = direct_rate(pipeline, batch, params, args.seconds)
            result["direct"][str(batch)] = rate
            print(f"direct eager batch {batch}: {rate:.2f} img/s", flush=True)
        del pipeline
        torch.cuda.empty_cache()

    guess = result.get("direct", {}).get(str(spec.max_batch_size))
    if "worker" in args.stages or "open-loop" in args.stages:
        runner = DiffusionRunner(spec.model_copy(update={"scheduling": "step"}), weights)
        runner.warm_up()
        for scheduling in ("request", "step") if "worker" in args.stages else ():
            rate = worker_rate(runner, spec.model_copy(update={"scheduling": scheduling}), params, args.seconds, guess)
            result["worker" if scheduling == spec.scheduling else f"worker_{scheduling}_level"] = rate
            print(f"worker eager, {scheduling}-level, single-image requests: {rate['images_per_s']:.2f} img/s "
                  f"in batches of {spec.max_batch_size}", flush=True)  # fmt: skip
        if "open-loop" in args.stages:
            from bench import open_loop

            backend = open_loop.InProcessBackend(runner, spec, GPU_STEP_MIX, args.size)
            multiples = open_loop.RATE_MULTIPLES["full"]
            result["open_loop"] = open_loop.sweep(
                backend, multiples, requests=60, repeats=open_loop.LONE_REPEATS["full"]
            )
            open_loop.print_targets(result["open_loop"])
            open_loop.plot({"H100-class GPU, SD-1.5-sized, 512x512": result["open_loop"]},
                           args.json.with_name("gpu_open_loop.png"))  # fmt: skip
        del runner
        torch.cuda.empty_cache()

    if "compiled" in args.stages:
        began = time.perf_counter()
        runner = DiffusionRunner(spec, weights, compile_unet=True, compile_cache=compile_cache(args.workdir, spec))
        runner.warm_up()  # compiles every batch bucket, then saves the artifacts
        result["compile_seconds"] = time.perf_counter() - began
        print(f"compiled and warmed up in {result['compile_seconds']:.0f}s", flush=True)
        # The compiled pipeline object itself, called directly: the compiled counterpart of `direct`.
        compiled_direct = direct_rate(runner._pipeline, spec.max_batch_size, params, args.seconds)  # noqa: SLF001
        result["direct_compiled"] = {str(spec.max_batch_size): compiled_direct}
        print(f"direct compiled batch {spec.max_batch_size}: {compiled_direct:.2f} img/s", flush=True)
        result["worker_compiled"] = worker_rate(runner, spec, params, args.seconds, compiled_direct)
        print(f"worker compiled, single-image requests: {result['worker_compiled']['images_per_s']:.2f} img/s",
              flush=True)  # fmt: skip
        if spec.adapters is not None:
            result["compiled_adapters"] = compiled_adapters(runner, spec, weights, args.workdir, params)
        del runner
        torch.cuda.empty_cache()

    if "compiled-plain" in args.stages:
        plain = spec.model_copy(update={"adapters": None})
        runner = DiffusionRunner(plain, weights, compile_unet=True)
        runner.warm_up()
        rate = direct_rate(runner._pipeline, plain.max_batch_size, params, args.seconds)  # noqa: SLF001
        result["direct_compiled_plain"] = {str(plain.max_batch_size): rate}
        print(f"direct compiled without adapter slots, batch {plain.max_batch_size}: {rate:.2f} img/s", flush=True)
        del runner
        torch.cuda.empty_cache()

    if "warm-start" in args.stages:
        with tempfile.TemporaryDirectory(prefix="inductor-empty-") as empty:
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": empty, "TRITON_CACHE_DIR": empty}
            argv = [sys.executable, "-m", "bench.gpu_pipeline", "--workdir", str(args.workdir), "--steps",
                    str(args.steps), "--size", str(args.size), "--warm-start-child", str(time.time())]  # fmt: skip
            done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        if done.returncode == 0 and lines:
            result["warm_start_first_request_s"] = json.loads(lines[-1])["first_request_s"]
            print(f"fresh process with saved artifacts: first request answered "
                  f"{result['warm_start_first_request_s']:.0f}s after start", flush=True)  # fmt: skip
        else:
            result["warm_start_error"] = done.stderr[-2000:]
            print(f"warm start failed:\n{done.stderr[-2000:]}", flush=True)

    print_summary(result, spec.max_batch_size)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    return 0


def quantization_comparison(args) -> int:
    """`--quantization`: quantized_pipeline.py's comparison, its rows added to the JSON under `quantization`."""
    import torch

    from bench.quantized_pipeline import compare, summary

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    print(f"{device}, torch {torch.__version__}; {args.family}{' (tiny)' if args.tiny else ''}: the serving dtype "
          f"against {', '.join(args.quantization)}", flush=True)  # fmt: skip
    eager = bool({"direct", "worker", "open-loop"} & set(args.stages))
    rows = compare(args.family, args.quantization, eager, "compiled" in args.stages, args.tiny, args.workdir,
                   args.size, args.steps if args.steps != DEFAULT_STEPS else None, args.calls)  # fmt: skip
    print("\n" + summary(rows))
    result = json.loads(args.json.read_text()) if args.json.exists() else {}
    result.setdefault("quantization", {})[f"{args.family}{'-tiny' if args.tiny else ''}"] = {
        "device": device,
        "torch": torch.__version__,
        "rows": rows,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    return 0


def print_summary(result: dict, batch: int) -> None:
    direct = result.get("direct", {})
    print("\n| path | " + " | ".join(f"batch {b}" for b in direct) + " |")
    print("|---|" + "---|" * len(direct))
    print("| diffusers direct, eager | " + " | ".join(f"{v:.2f}" for v in direct.values()) + " |")
    checks = [
        ("eager", direct.get(str(batch)), result.get("worker")),
        ("compiled", result.get("direct_compiled", {}).get(str(batch)), result.get("worker_compiled")),
    ]
    print("\nTargets (printed, not asserted):")
    for name, reference, worker in checks:
        if reference and worker:
            rate = worker["images_per_s"]
            verdict = "PASS" if rate >= 0.9 * reference else "MISS"
            print(f"  {verdict} worker {name}, single-image requests: {rate:.2f} img/s vs 90% of direct "
                  f"batch {batch} {0.9 * reference:.2f}")  # fmt: skip
    adapters = result.get("compiled_adapters")
    if adapters is not None:
        recompiles = adapters["recompiles"]
        print(f"  {'PASS' if recompiles == 0 else 'MISS'} compiled model with adapters: {recompiles} graphs compiled "
              "after its warm-up (target 0)")  # fmt: skip
    with_slots = result.get("direct_compiled", {}).get(str(batch))
    without = result.get("direct_compiled_plain", {}).get(str(batch))
    if with_slots and without:
        print(f"  (printed only) compiled batch {batch}: {with_slots:.2f} img/s with empty adapter slots, "
              f"{without:.2f} without ({with_slots / without:.2f}x)")  # fmt: skip
    if "warm_start_first_request_s" in result:
        seconds = result["warm_start_first_request_s"]
        print(
            f"  {'PASS' if seconds <= 60 else 'MISS'} first request of a fresh compiled worker: {seconds:.0f}s (target 60s)"
        )


if __name__ == "__main__":
    sys.exit(main())
