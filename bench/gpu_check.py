"""One command for the GPU: the worker's model path on a lent card, each figure as a line PASS or MISS against its
target, in one table (`make gpu-check`; issue 42's item 6).

    python -m bench.gpu_check                 # a CUDA GPU: real sizes, random weights built here (~8 minutes)
    python -m bench.gpu_check --tiny          # a CPU: the same code at tiny sizes (under two minutes)
    python -m bench.gpu_check --lines flux    # only these lines and those under them (`flux` selects `flux.bf16`)

Lines, cheapest and most informative first (`LINES`): SD-1.5-sized eager (direct batch 8, the worker's pool, device
loop and finisher at step and request level, lone 12- and 25-step requests, host reads per denoising step), batch
lines beside an interactive request, the open-loop sweep up to the batch capacity, the same model compiled in the
catalog's compile mode (compile seconds, worker img/s against the card's bound, graphs made by adapter swaps, a
fresh process's first answer from the saved artifacts), then FLUX.1 [schnell] at its real size, bf16 and float8,
eager and compiled, against the memory plan, and the 2026 families (Z-Image-Turbo, FLUX.2 [klein] 4B, Qwen-Image) at
their real sizes, one image at the catalog's defaults in bf16 and float8, eager, against the memory plan; then FLUX.1's
inpaint and edit models (Fill [dev] and Kontext [dev], issue 51) likewise at 1024², with an input image (and mask).

Each line is its own function, guarded: an error, a missing feature or a spent budget makes its line a MISS with the
reason, and the rest still run. The whole run has one deadline (`--budget`); a line is skipped when less is left
than it needs, and the lines that compile or load FLUX.1 run in child processes killed at their share of the time.
On a CPU the targets that only mean something on a GPU (rates, latency ratios, memory) print as INFO. The table is
printed and written with the JSON under `--out`. Only the contract, the worker's model path and the bench are
imported: where the serving modules' service clients are absent (a GPU image), bench/client_stand_ins.py stands in
for them at import (every service is in memory here anyway).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The card's bound for an SD-1.5-sized image at 512x512, 25 steps, guidance on: 42.7 TFLOP at the H100's measured
# 761 TFLOP/s fp16 matmul rate (../shared/gpu/H100-2026-11.md).
SD15_BOUND_IMAGES_PER_S = 17.8
SHARE_OF_BOUND = 0.5
SHARE_OF_DIRECT = 0.95
LONE_RATIO = 1.05
BATCH_LINE_RATIO = 1.3
WARM_START_SECONDS = 60.0
# The compiled SD line's least share of the run: a default compile mode a worker can afford at start fits in it. It
# gets more when the budget allows: what is left less what the selected lines after it need (`compile_cap`), so a
# run of the compiled lines alone (`--lines sd15-compiled --budget 400`) gives inductor most of its budget.
COMPILE_CAP = 100.0
# A quantized model's measured memory against its plan: the plan's weights within this share.
PLAN_TOLERANCE = 1.05
FLUX_KINDS = (None, "float8_weight_only", "float8_dynamic")
FLUX_TINY_STEPS = 2
# Offered rates, as shares of the batch capacity (tiny: two rates).
OPEN_LOOP_SHARES = {"gpu": (0.25, 0.5, 0.75, 1.0), "tiny": (0.5, 1.0)}
# Seconds for the whole run. Tiny: a safeguard on a crowded machine (a quiet one runs it in under two minutes).
DEFAULT_BUDGET = {"gpu": 420.0, "tiny": 300.0}
PASS, MISS, INFO = "PASS", "MISS", "INFO"


@dataclass(frozen=True)
class Sizes:
    """What the run measures at: the real sizes on a GPU, tiny ones on a CPU."""

    size: int
    steps: int
    lone_steps: tuple[int, ...]
    batch: int
    seconds: float  # measurement time of a rate
    repeats: int  # lone latencies: the median of this many
    open_loop_requests: int
    batch_line_requests: int
    flux_size: int
    flux_calls: int
    compiled_batch: int  # the compiled model's max_batch_size (its buckets)


GPU = Sizes(512, 25, (12, 25), 8, 6.0, 3, 16, 3, 1024, 2, 8)
TINY = Sizes(64, 4, (2, 4), 8, 1.5, 3, 4, 3, 64, 1, 1)


@dataclass
class Line:
    key: str
    name: str
    result: str  # PASS, MISS or INFO
    measured: str
    target: str
    detail: dict = field(default_factory=dict)


class Check:
    """The run's state: its deadline, the lines so far, what the lines share (the SD runner, measured rates)."""

    def __init__(self, tiny: bool, budget: float, workdir: Path, out: Path, selected: list[str] | None,
                 compile_cap: float | None = None) -> None:  # fmt: skip
        import torch

        self.tiny = tiny
        self.cuda = torch.cuda.is_available() and not tiny
        self.sizes = TINY if tiny else GPU
        self.started = time.monotonic()
        self.deadline = self.started + budget
        self.workdir, self.out = workdir, out
        self.selected = selected
        self.compile_cap = compile_cap  # `--compile-cap`: the compiled line's seconds, whatever the budget
        self.lines: list[Line] = []
        self.shared: dict = {}
        self.device = torch.cuda.get_device_name(0) if self.cuda else "cpu"

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def log(self, message: str) -> None:
        stamp = time.strftime("%H:%M:%S", time.gmtime())
        print(f"[{stamp} +{time.monotonic() - self.started:5.0f}s] {message}", flush=True)

    def add(self, key: str, name: str, result: str, measured: str, target: str, **detail) -> None:
        line = Line(key, name, result, measured, target, detail)
        self.lines.append(line)
        self.log(f"{result:<4} {name}: {measured} (target {target})")

    def judged(self, ok: bool) -> str:
        """PASS or MISS on a GPU; INFO on a CPU, where rates and latency ratios say nothing about the card."""
        return INFO if not self.cuda else (PASS if ok else MISS)

    def sync(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize()


# --- SD-1.5-sized, eager ------------------------------------------------------------------------------------


def sd15_spec(check: Check, scheduling: str = "step", batch: int | None = None):
    """The production catalog's entry; on a CPU at the tiny pipeline's size."""
    from contract.catalog import load_catalog

    spec = load_catalog().get("sd15-txt2img")
    sizes = check.sizes
    defaults = spec.defaults.model_copy(
        update={"width": sizes.size, "height": sizes.size, "num_inference_steps": sizes.steps}
    )
    return spec.model_copy(
        update={"scheduling": scheduling, "defaults": defaults, "max_batch_size": batch or spec.max_batch_size}
    )


def sd15_weights(check: Check) -> Path:
    from bench.quantized_pipeline import weights_for

    if "sd15_weights" not in check.shared:
        started = time.perf_counter()
        check.shared["sd15_weights"] = weights_for("sd15", check.tiny, check.workdir)
        check.log(f"SD-1.5-sized weights ready in {time.perf_counter() - started:.0f}s")
    return check.shared["sd15_weights"]


def sd15_runner(check: Check):
    """One eager runner (step scheduling, so it can also step), loaded and warmed up once for the eager lines."""
    if "sd15_runner" not in check.shared:
        from model_worker.model.pipeline import DiffusionRunner

        weights = sd15_weights(check)
        started = time.perf_counter()
        runner = DiffusionRunner(sd15_spec(check), weights, torch_threads=2 if check.tiny else 0)
        runner.warm_up()
        check.shared["sd15_runner"] = runner
        check.log(f"SD-1.5-sized runner loaded and warmed up in {time.perf_counter() - started:.0f}s")
    return check.shared["sd15_runner"]


def release_sd15(check: Check) -> None:
    import gc

    check.shared.pop("sd15_runner", None)
    gc.collect()
    if check.cuda:
        import torch

        torch.cuda.empty_cache()


def params(spec, steps: int, size: int):
    from contract.messages import GenerationParameters

    return GenerationParameters(
        seed=0, num_inference_steps=steps, guidance_scale=spec.defaults.guidance_scale, width=size, height=size
    )


def line_direct(check: Check) -> None:
    """The diffusers pipeline itself (the runner's own object) called back to back at batch 8: the reference."""
    import torch

    runner = sd15_runner(check)
    sizes = check.sizes
    spec = runner.spec
    p = params(spec, sizes.steps, sizes.size)

    def call(seed: int) -> None:
        with torch.inference_mode():
            runner._pipeline(  # noqa: SLF001 - the bare pipeline is the reference
                prompt=[f"check {seed + i}" for i in range(sizes.batch)],
                num_inference_steps=p.num_inference_steps, guidance_scale=p.guidance_scale, width=p.width,
                height=p.height, output_type="np",
                generator=[torch.Generator(device="cpu").manual_seed(seed + i) for i in range(sizes.batch)],
            )  # fmt: skip

    call(0)
    check.sync()
    calls, started = 0, time.perf_counter()
    while calls < 2 or time.perf_counter() - started < sizes.seconds:
        call(calls * sizes.batch)
        calls += 1
    check.sync()
    rate = calls * sizes.batch / (time.perf_counter() - started)
    check.shared["direct"] = rate
    check.add("sd15.direct", f"SD-1.5-sized eager, diffusers direct, batch {sizes.batch}", INFO,
              f"{rate:.2f} img/s", "reference", images_per_s=rate)  # fmt: skip


def worker_line(check: Check, scheduling: str) -> None:
    from bench.worker_harness import worker_images_per_second

    runner = sd15_runner(check)
    sizes = check.sizes
    spec = sd15_spec(check, scheduling)
    guess = check.shared.get("direct", 2.0)
    images = max(3 * sizes.batch, int(sizes.seconds * guess) // sizes.batch * sizes.batch)
    timer = PhaseTimer(runner)  # no sync: it only records each model call's images
    measured = worker_images_per_second(timer, spec, params(spec, sizes.steps, sizes.size), sizes.batch, images,
                                        warmup_images=sizes.batch)  # fmt: skip
    began, ended = measured["window"]
    counted = [images for at, images in timer.calls if began < at <= ended]
    measured["images_per_call"] = statistics.mean(counted) if counted else float("nan")
    rate = measured["images_per_s"]
    check.shared[f"worker_{scheduling}"] = rate
    direct = check.shared.get("direct")
    share = rate / direct if direct else None
    shown = f"{rate:.2f} img/s" + (f" = {share:.0%} of direct" if share else "")
    calls = measured["pipeline_calls"]
    check.add(f"sd15.worker-{scheduling}", f"SD-1.5-sized eager, worker {scheduling}-level, single-image requests",
              check.judged(share is not None and share >= SHARE_OF_DIRECT) if share else MISS,
              f"{shown}, {calls} model calls for {measured['images']} images, "
              f"{measured['images_per_call']:.1f} images a call while measured",
              f">= {SHARE_OF_DIRECT:.0%} of direct batch {sizes.batch}", **measured, share_of_direct=share)  # fmt: skip


def line_worker_request(check: Check) -> None:
    worker_line(check, "request")


def line_worker_step(check: Check) -> None:
    worker_line(check, "step")


def line_lone(check: Check) -> None:
    """A lone request through the worker's path, step-level against request-level (the two interleaved)."""
    from bench import open_loop

    runner = sd15_runner(check)
    sizes = check.sizes
    backend = open_loop.InProcessBackend(runner, sd15_spec(check), sizes.lone_steps, sizes.size)
    try:
        lone = backend.lone(sizes.repeats)
    finally:
        backend.close()
    check.shared["lone_ms"] = lone
    for steps in sizes.lone_steps:
        request, step = lone["request"][str(steps)], lone["step"][str(steps)]
        ratio = step / request
        check.add(f"sd15.lone-{steps}", f"SD-1.5-sized eager, lone {steps}-step request, step / request-level",
                  check.judged(ratio <= LONE_RATIO), f"{ratio:.2f}x ({step:.0f} / {request:.0f} ms)",
                  f"<= {LONE_RATIO}x", step_ms=step, request_ms=request)  # fmt: skip
    steps = sizes.lone_steps[-1]
    phases = lone_phases(check, runner, steps)
    step, request = phases["step"], phases["request"]
    check.add(f"sd15.lone-{steps}-phases", f"lone {steps}-step request, where the time goes (each phase synchronized)",
              INFO, f"step-level: start {step['start']:.0f}, {step['calls']} steps {step['step']:.0f} "
              f"({step['step'] / max(step['calls'], 1):.1f} each), decode {step['decode']:.0f}, to the reply "
              f"{step['reply']:.0f} ms; request-level: call {request['generate']:.0f} (to its first step's end "
              f"{request.get('to_first_step', 0):.0f}, after its last {request.get('after_last_step', 0):.0f}), to "
              f"the reply {request['reply']:.0f} ms", "diagnosis", **phases)  # fmt: skip


class PhaseTimer:
    """The runner with each of its device calls timed: with `sync` (CUDA's synchronize) after each, so that a phase
    holds its own GPU work (the lone latencies above are measured without this), or none, to see what the device
    loop asks of the model without changing it. `calls`: (when it returned, images) of each model call."""

    def __init__(self, runner, sync=None) -> None:
        self._runner, self._sync = runner, sync or (lambda: None)
        self.phases: dict[str, float] = {}
        self.calls: list[tuple[float, int]] = []
        self.returned = 0.0  # when the last device call returned: the finisher's part starts there

    def __getattr__(self, name: str):
        return getattr(self._runner, name)

    def _timed(self, phase: str, images: int, call, *args):
        began = time.perf_counter()
        out = call(*args)
        self._sync()
        self.returned = time.perf_counter()
        self.phases[phase] = self.phases.get(phase, 0.0) + (self.returned - began) * 1000
        if phase in ("step", "generate"):
            self.calls.append((self.returned, images))
        return out

    def start_items(self, items, params):
        return self._timed("start", len(items), self._runner.start_items, items, params)

    def denoise_step(self, running) -> None:
        return self._timed("step", len(running), self._runner.denoise_step, running)

    def decode(self, running):
        return self._timed("decode", len(running), self._runner.decode, running)

    def generate(self, items, params, on_step):
        """The pipeline call, its steps' ends marked (synchronized) through its step callback: the part before
        its first step's end (encoding, latents, one step) and after its last (the decode) show apart."""
        marks: list[float] = []

        def marked(step: int, total: int) -> None:
            self._sync()
            marks.append(time.perf_counter())
            on_step(step, total)

        began = time.perf_counter()
        out = self._timed("generate", len(items), self._runner.generate, items, params, marked)
        if marks:
            self.phases["to_first_step"] = (marks[0] - began) * 1000
            self.phases["after_last_step"] = (self.returned - marks[-1]) * 1000
        return out


def lone_phases(check: Check, runner, steps: int, repeats: int = 3) -> dict[str, dict]:
    """Per scheduling, the median over `repeats` lone requests of each phase's milliseconds (start, steps, decode;
    or the pipeline call) and of the finisher's part (the last device call's return to the reply's publish)."""
    from bench import open_loop

    timer = PhaseTimer(runner, check.sync)
    worker_size = check.sizes.size
    out: dict[str, dict] = {}
    backend = open_loop.InProcessBackend(timer, sd15_spec(check), (steps,), worker_size)
    try:
        for scheduling, worker in backend.workers.items():
            seen: list[dict] = []
            for repeat in range(repeats):
                timer.phases, timer.calls = {}, []
                pending = open_loop.pending_request(worker.spec, steps, 2000 + repeat, worker.size)
                worker.submit(pending)
                worker.wait([pending.request_id], timeout=120)
                reply = (worker.answered[pending.request_id] - timer.returned) * 1000
                seen.append({**timer.phases, "calls": len(timer.calls), "reply": reply})
            out[scheduling] = {key: statistics.median(row[key] for row in seen) for key in seen[0]}
    finally:
        backend.close()
    return out


HOST_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")


class HostReads:
    """Counts reads of tensors back to the host on this thread (`.item()`, `.tolist()`, `.cpu()`, `bool()`...)
    while active; on CUDA also the synchronizing calls CUDA's sync debug mode warns about."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.reads: dict[str, int] = {}
        self.syncs = 0
        self.sync_sites: dict[str, int] = {}
        self._thread = threading.get_ident()

    def __enter__(self) -> HostReads:
        import warnings

        import torch

        self._saved = {name: torch.Tensor.__dict__.get(name) for name in HOST_READS}
        for name in HOST_READS:
            original = getattr(torch.Tensor, name)
            setattr(torch.Tensor, name, self._counting(name, original))
        if self.cuda:
            self._warnings = warnings.catch_warnings(record=True)
            self._seen = self._warnings.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def _counting(self, name: str, original: Callable) -> Callable:
        def counted(tensor, *args, **kwargs):
            # On CUDA only a device tensor's read goes back to the host; on a CPU every read is counted.
            if threading.get_ident() == self._thread and (not self.cuda or tensor.is_cuda):
                self.reads[name] = self.reads.get(name, 0) + 1
            return original(tensor, *args, **kwargs)

        return counted

    def __exit__(self, *exc) -> None:
        import torch

        if self.cuda:
            torch.cuda.set_sync_debug_mode("default")
            synced = [w for w in self._seen if "synchroniz" in str(w.message)]
            self.syncs = len(synced)
            # Where each came from: the Python line that made the synchronizing call (the warning's frame).
            for w in synced:
                where = f"{Path(w.filename).name}:{w.lineno}"
                self.sync_sites[where] = self.sync_sites.get(where, 0) + 1
            self._warnings.__exit__(*exc)
        for name, saved in self._saved.items():
            if saved is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, saved)


def line_syncs(check: Check) -> None:
    """Steps of a running set with two step counts: what each step reads back to the host (the target: nothing)."""
    from model_worker.model.runners import GenerationItem

    runner = sd15_runner(check)
    sizes = check.sizes
    spec = runner.spec
    half = max(1, sizes.batch // 2)
    running = []
    mix = [max(steps, 6) for steps in sizes.lone_steps[:2]]  # none finishes while counted
    for offset, steps in enumerate(mix):
        items = [GenerationItem(prompt=f"sync {offset}-{i}", seed=i) for i in range(half)]
        running += runner.start_items(items, params(spec, steps, sizes.size))
    runner.denoise_step(running)  # the first step may set things up once
    check.sync()
    steps = 3
    with HostReads(check.cuda) as counted:
        for _ in range(steps):
            runner.denoise_step(running)
    reads = sum(counted.reads.values())
    per_step = max(reads, counted.syncs) / steps  # a device tensor's `.item()` is both a read and a sync
    what = ", ".join(f"{name} {count}" for name, count in sorted(counted.reads.items())) or "none"
    sites = ", ".join(f"{site} x{count}" for site, count in sorted(counted.sync_sites.items()))
    cuda = f"; CUDA syncs {counted.syncs / steps:.1f}/step{f' at {sites}' if sites else ''}" if check.cuda else ""
    check.add("sd15.syncs", f"SD-1.5-sized eager, host reads per denoising step (batch {len(running)}, "
              f"{'/'.join(map(str, mix))} steps)", PASS if per_step == 0 else MISS,
              f"{per_step:.1f}/step (reads: {what}{cuda})", "0", reads=counted.reads, cuda_syncs=counted.syncs,
              sync_sites=counted.sync_sites, steps=steps)  # fmt: skip


def line_scheduler_steps(check: Check) -> None:
    """The scheduler step alone at batch 8, SD-1.5-sized latents, each of the seven steppable schedulers: the whole
    running set at once (what the worker does) against each image's own diffusers scheduler; operations dispatched
    (a kernel launch each) and milliseconds per step (synchronized on CUDA)."""
    from bench.scheduler_steps import SCHEDULERS, host_ms, measure

    device = "cuda" if check.cuda else "cpu"
    images, steps = check.sizes.batch, 8
    rows, shown = {}, []
    for name in SCHEDULERS:
        row = {}
        for vectorised in (True, False):
            label = "set" if vectorised else "per_image"
            row[f"{label}_ops"] = measure(name, images, steps, device, vectorised)["operations"]
            row[f"{label}_ms"] = host_ms(name, images, steps, device, vectorised)
        rows[name] = row
        shown.append(f"{name.removesuffix('Scheduler')} {row['set_ops']:.0f}/{row['set_ms']:.2f} "
                     f"({row['per_image_ops']:.0f}/{row['per_image_ms']:.2f})")  # fmt: skip
    check.add("sd15.scheduler-steps", f"scheduler step of {images} images: ops / ms, whole set (per image)", INFO,
              "; ".join(shown), "reference", **rows)  # fmt: skip


# --- step caches (issue 54) ----------------------------------------------------------------------------------

# The real sizes' steps (FLUX.1 [dev]'s and SD 3.5's 28 at 1024², SD 1.5's 25 at 512²) and the tiny run's. Each
# image's first STEP_CACHE_WARMUP steps run in full, then every other step skips (about half of them: the published
# hit rates' order, forced, since random weights say nothing about hit rates; docs/guides/step-caching.md).
STEP_CACHE_STEPS = {"flux": (28, 4), "sd15": (25, 4), "sd35": (28, 4)}
STEP_CACHE_WARMUP = (2, 1)
# Each line's cache (the forced pattern decides in place of the threshold or interval).
STEP_CACHE_SETTINGS = {"sd15.step-cache": {"kind": "deepcache", "interval": 2},
                       "flux.step-cache": {"kind": "first_block", "threshold": 0.08},
                       "flux.taylorseer": {"kind": "taylorseer", "interval": 2},
                       "sd35.step-cache": {"kind": "first_block", "threshold": 0.08}}  # fmt: skip


def skip_half(running_item, step: int) -> bool:
    return step % 2 == 1


def step_cache_spec(check: Check, spec, line: str):
    """The entry with the line's step cache, its warm-up the check's, stepped (the per-image cache's scheduling)."""
    from contract.model_spec import ModelSpec

    settings = {**STEP_CACHE_SETTINGS[line], "warmup_steps": STEP_CACHE_WARMUP[check.tiny]}
    return ModelSpec.model_validate({**spec.model_dump(), "scheduling": "step", "step_cache": settings})


def step_cache_times(check: Check, runner, family: str, images: int, size: int) -> dict:
    """One running set of `images` through all its steps with the cache (the forced pattern) and without (the
    request's `step_cache: false`, the plain call) on one runner: milliseconds per step (synchronized), the steps
    each image skipped. A short untimed set of each first (kernels, allocations)."""
    from contract.messages import GenerationParameters
    from model_worker.model.runners import GenerationItem

    steps = STEP_CACHE_STEPS[family][check.tiny]
    guidance = runner.spec.defaults.guidance_scale

    def one_set(asked: bool | None, count: int) -> tuple[float, int]:
        p = GenerationParameters(seed=0, num_inference_steps=count, guidance_scale=guidance, width=size, height=size,
                                 step_cache=asked)  # fmt: skip
        running = runner.start_items([GenerationItem(prompt=f"cache {i}", seed=i) for i in range(images)], p)
        check.sync()
        began = time.perf_counter()
        while not all(r.finished for r in running):
            runner.denoise_step(running)
        check.sync()
        elapsed = (time.perf_counter() - began) * 1000 / count
        skipped = running[0].skipped
        runner.decode(running)
        return elapsed, skipped

    runner._denoiser.forced_skips = skip_half  # noqa: SLF001 - the bench's forced pattern in place of the threshold
    for asked in (False, None):
        one_set(asked, min(steps, 4))
    (plain_ms, _), (cached_ms, skipped) = one_set(False, steps), one_set(None, steps)
    return {
        "steps": steps,
        "images": images,
        "size": size,
        "ms_per_step_without": plain_ms,
        "ms_per_step_with": cached_ms,
        "steps_skipped_per_image": skipped,
        "speedup": plain_ms / cached_ms,
    }


def add_step_cache_line(check: Check, key: str, name: str, row: dict) -> None:
    check.add(key, f"{name} {row['size']}², {row['steps']} steps, {row['images']} image(s), half the steps after "
              f"warm-up skipped (forced)", INFO,
              f"{row['ms_per_step_with']:.1f} ms/step with the cache, {row['ms_per_step_without']:.1f} without "
              f"(x{row['speedup']:.2f}), {row['steps_skipped_per_image']} of {row['steps']} steps skipped an image",
              "reported", **row)  # fmt: skip


def line_sd15_step_cache(check: Check) -> None:
    """SD-1.5-sized deepcache: the eager runner's loaded pipeline with the cache, a batch of images stepped."""
    from model_worker.model.pipeline import DiffusionRunner

    shared = sd15_runner(check)
    spec = step_cache_spec(check, shared.spec, "sd15.step-cache")
    runner = DiffusionRunner(spec, sd15_weights(check), torch_threads=2 if check.tiny else 0, share=shared)
    row = step_cache_times(check, runner, "sd15", check.sizes.batch, check.sizes.size)
    add_step_cache_line(check, "sd15.step-cache", "SD-1.5-sized eager, deepcache", row)


# --- ControlNets per row (issue 53) --------------------------------------------------------------------------

# A ControlNet's cost per step beside the plain step, at which its line passes: SD 1.5's is a copy of the UNet's
# encoder and mid block (about half the UNet's work); InstantX's FLUX.1 ControlNet 5 double and 10 single blocks
# beside the transformer's 19 and 38 (about a quarter).
CONTROLNET_OVERHEAD = {"sd15": 1.7, "flux": 1.5}
FLUX_CONTROLNET_BLOCKS = {"gpu": (5, 10), "tiny": (1, 1)}


def controlnet_times(check: Check, runner, controlnet, images: int, size: int, steps: int) -> dict:
    """One running set of `images` through all its steps, every image with the ControlNet (scale 0.8, a square's
    control image) and without it, on one runner: milliseconds per step (synchronized). A short untimed set of each
    first (kernels, allocations, the ControlNet moved to the device)."""
    from PIL import Image

    from contract.generation import ControlRef
    from contract.messages import GenerationParameters
    from model_worker.controls.loader import ControlSet, ControlWeights
    from model_worker.model.runners import GenerationItem

    weights = ControlWeights("bench-edges", "controlnet", "1", "bench", 0, controlnet)
    ref = ControlRef(name="bench-edges", kind="controlnet", version="1", sha256="bench", scale=0.8)
    image = Image.new("RGB", (size, size))
    image.paste((255, 255, 255), (size // 4, size // 4, 3 * size // 4, 3 * size // 4))
    guidance = runner.spec.defaults.guidance_scale

    def one_set(controlled: bool, count: int) -> float:
        controls = ControlSet((ref,), loaded=[weights])
        controls.done.set()
        items = [GenerationItem(prompt=f"control {i}", seed=i, controls=controls if controlled else None,
                                control_images=(image,) if controlled else ()) for i in range(images)]  # fmt: skip
        p = GenerationParameters(seed=0, num_inference_steps=count, guidance_scale=guidance, width=size, height=size)
        running = runner.start_items(items, p)
        check.sync()
        began = time.perf_counter()
        while not all(r.finished for r in running):
            runner.denoise_step(running)
        check.sync()
        elapsed = (time.perf_counter() - began) * 1000 / count
        runner.decode(running)
        return elapsed

    for controlled in (False, True):
        one_set(controlled, min(steps, 2))
    plain_ms, controlled_ms = one_set(False, steps), one_set(True, steps)
    return {"steps": steps, "images": images, "size": size, "ms_per_step_without": plain_ms,
            "ms_per_step_with": controlled_ms, "overhead": controlled_ms / plain_ms}  # fmt: skip


def add_controlnet_line(check: Check, key: str, name: str, family: str, row: dict) -> None:
    bound = CONTROLNET_OVERHEAD[family]
    check.add(key, f"{name} {row['size']}², {row['steps']} steps, {row['images']} image(s), every image with one "
              "ControlNet, against the same set without", check.judged(row["overhead"] <= bound),
              f"{row['ms_per_step_with']:.1f} ms/step with the ControlNet, {row['ms_per_step_without']:.1f} without "
              f"(x{row['overhead']:.2f})", f"<= {bound}x the plain step", **row)  # fmt: skip


def line_sd15_controlnet(check: Check) -> None:
    """SD-1.5-sized eager with one ControlNet (`ControlNetModel.from_unet` of the loaded UNet: the real size, its
    weights the UNet's), per row of the shared call (model_worker/controls/controlnets.py)."""
    from diffusers import ControlNetModel

    runner = sd15_runner(check)
    controlnet = ControlNetModel.from_unet(runner._pipeline.unet)  # noqa: SLF001 - the bench reads the loaded UNet
    row = controlnet_times(check, runner, controlnet, check.sizes.batch, check.sizes.size, check.sizes.steps)
    add_controlnet_line(check, "sd15.controlnet", "SD-1.5-sized eager, ControlNet", "sd15", row)


def line_flux_controlnet(check: Check) -> None:
    """FLUX.1 [schnell] bf16 eager with an InstantX-sized ControlNet (`FluxControlNetModel.from_transformer`: 5 double
    and 10 single blocks, random), one image per set (model_worker/controls/flux_controlnets.py)."""
    if "flux_weights" not in check.shared:
        line_flux_build(check)
    row = run_child(check, "flux-controlnet", {"weights": check.shared["flux_weights"]}, cap=180.0)
    add_controlnet_line(check, "flux.controlnet", "FLUX.1 [schnell] bf16 eager, ControlNet", "flux", row)


def child_flux_controlnet(check: Check, args: dict) -> dict:
    import torch
    from diffusers import FluxControlNetModel

    from bench.quantized_pipeline import variant_spec
    from model_worker.model.pipeline import DiffusionRunner

    size = check.sizes.flux_size
    spec = variant_spec("flux", None, size).model_copy(update={"scheduling": "step"})
    runner = DiffusionRunner(spec, Path(args["weights"]), torch_threads=2 if check.tiny else 0)
    transformer = runner._pipeline.transformer  # noqa: SLF001 - the bench reads the loaded transformer
    config = transformer.config
    double, single = FLUX_CONTROLNET_BLOCKS["tiny" if check.tiny else "gpu"]
    with torch.device(transformer.device):
        controlnet = FluxControlNetModel.from_transformer(
            transformer, num_layers=double, num_single_layers=single, attention_head_dim=config.attention_head_dim,
            num_attention_heads=config.num_attention_heads,
        )  # fmt: skip
    steps = FLUX_TINY_STEPS if check.tiny else spec.defaults.num_inference_steps
    return controlnet_times(check, runner, controlnet.to(dtype=transformer.dtype), 1, size, steps)


# --- batch lines and the open loop ---------------------------------------------------------------------------


def line_batch_lines(check: Check) -> None:
    """An interactive request's latency alone and beside batch lines run at the model's max_batch_size."""
    from bench.worker_harness import interactive_latencies

    runner = sd15_runner(check)
    sizes = check.sizes
    spec = sd15_spec(check)
    p = params(spec, sizes.steps, sizes.size)
    lone = check.shared.get("lone_ms", {}).get("step", {}).get(str(sizes.steps))
    gap = (lone / 1000) if lone else (1.0 if check.cuda else 0.2)
    runs = {}
    for backlog in (False, True):
        runs[backlog] = interactive_latencies(runner, spec, p, sizes.batch_line_requests, gap, backlog,
                                              batch_images=spec.max_batch_size)  # fmt: skip
    alone, beside = runs[False]["mean_s"], runs[True]["mean_s"]
    ratio = beside / alone
    check.add("batch.interactive", f"batch lines at batch {spec.max_batch_size}: interactive latency beside them / alone",
              check.judged(ratio <= BATCH_LINE_RATIO),
              f"{ratio:.2f}x ({beside * 1000:.0f} / {alone * 1000:.0f} ms mean; "
              f"{runs[True]['batch_lines_done']} batch lines done)", f"<= {BATCH_LINE_RATIO}x",
              alone=runs[False], beside=runs[True])  # fmt: skip


def line_open_loop(check: Check) -> None:
    """Poisson arrivals up to the batch capacity (not the lone rate), step-level against request-level."""
    from bench import open_loop

    runner = sd15_runner(check)
    sizes = check.sizes
    mix = sizes.lone_steps
    if not (check.shared.get("worker_request") or check.shared.get("direct")):
        line_direct(check)  # run alone (`--lines open-loop`): the batch rate first
    rate = check.shared.get("worker_request") or check.shared["direct"]
    capacity = rate * sizes.steps / statistics.fmean(mix)  # requests/s of the mix at a full batch
    rates = tuple(round(share * capacity, 2) for share in OPEN_LOOP_SHARES["tiny" if check.tiny else "gpu"])
    backend = open_loop.InProcessBackend(runner, sd15_spec(check), mix, sizes.size)
    result = open_loop.sweep(backend, (), sizes.open_loop_requests, sizes.repeats, progress=check.log, rates=rates,
                             lone_ms=check.shared.get("lone_ms"))  # fmt: skip
    check.shared["open_loop"] = result
    top = {s: max(result["points"][s], key=lambda p: p["offered_rps"]) for s in open_loop.SCHEDULINGS}
    check.add("open-loop.sweep", f"open loop {'/'.join(map(str, mix))} steps, rates {rates} req/s (capacity "
              f"{capacity:.1f})", INFO, f"at {rates[-1]} req/s: step-level {top['step']['slo_attainment']:.0%}, "
              f"request-level {top['request']['slo_attainment']:.0%} within SLO", "reference", sweep=result)  # fmt: skip
    for index, target in enumerate(t for t in result["targets"] if not t["target"].startswith("lone")):
        measured = "not reached" if target["measured"] is None else f"{target['measured']:.2f} {target['unit']}"
        passed = target["result"] == "PASS"
        check.add(f"open-loop.target-{index}", f"open loop: {target['target']}", check.judged(passed), measured,
                  f">= {target['threshold']} {target['unit']}")  # fmt: skip


# --- compiled ------------------------------------------------------------------------------------------------


def catalog_compile_mode(spec) -> str | None:
    """The compile mode the catalog names for the model, where the catalog has one (None: not available): a field
    whose name says compile, holding the mode itself or something with a `mode`."""
    names = [name for name in type(spec).model_fields if "compile" in name]
    for name in sorted(names, key=lambda n: n != "compile_mode"):
        value = getattr(spec, name, None)
        if isinstance(value, dict):
            value = value.get("mode")
        mode = value if isinstance(value, str) else getattr(value, "mode", None)
        if mode:
            return str(mode)
    return None


def compile_mode_or_refusal(check: Check, spec) -> tuple[str | None, str | None]:
    """(mode, None) to compile; (None, reason) where there is nothing to compile with. On a CPU torch.compile's
    eager backend stands in whatever the catalog says; on a GPU without a catalog mode nothing is compiled (the
    denoiser's built-in max-autotune did not fit a 10-minute run); a model that names none is compiled in the
    catalog's default mode (`compiled.DEFAULT_COMPILE_MODE`), as `MAAS_TORCH_COMPILE=1` compiles it."""
    mode = catalog_compile_mode(spec)
    if check.tiny:
        return f"eager backend (catalog: {mode or 'no compile mode'})", None
    if mode is None:
        try:
            from model_worker.model.compiled import DEFAULT_COMPILE_MODE
        except ImportError:
            return None, f"not available: the catalog names no compile mode for {spec.name}"
        return f"{DEFAULT_COMPILE_MODE} (the catalog's default)", None
    return mode, None


def line_sd15_compiled(check: Check) -> None:
    spec = sd15_spec(check)
    mode, refusal = compile_mode_or_refusal(check, spec)
    keys = ("sd15-compiled.seconds", "sd15-compiled.worker", "sd15-compiled.adapter-graphs")
    if refusal:
        for key in keys:
            check.add(key, f"SD-1.5-sized compiled: {key.split('.')[1]}", MISS, refusal, "a catalog compile mode")
        return
    weights = sd15_weights(check)
    cap = compile_cap(check)
    try:
        result = run_child(check, "sd15-compiled", {"weights": str(weights)}, cap=cap)
    except TimeoutError as exc:
        check.add(keys[0], f"SD-1.5-sized compiled ({mode}): compile and warm-up of buckets", MISS,
                  f"stopped: {exc}", f"<= {cap:.0f} s (this run's share)")  # fmt: skip
        return
    check.shared["compiled"] = True
    check.add(keys[0], f"SD-1.5-sized compiled ({mode}): compile and warm-up of buckets", INFO,
              f"{result['compile_s']:.0f} s", "reported", **result)  # fmt: skip
    rate = result["worker"]["images_per_s"]
    bound = SD15_BOUND_IMAGES_PER_S * SHARE_OF_BOUND
    check.add(keys[1], "SD-1.5-sized compiled, worker step-level, single-image requests",
              check.judged(rate >= bound), f"{rate:.2f} img/s = {rate / SD15_BOUND_IMAGES_PER_S:.0%} of the bound",
              f">= {bound:.1f} img/s ({SHARE_OF_BOUND:.0%} of {SD15_BOUND_IMAGES_PER_S})")  # fmt: skip
    graphs = result["adapters"]["recompiles"]
    check.add(keys[2], "SD-1.5-sized compiled, graphs made after warm-up, two adapters swapped",
              PASS if graphs == 0 else MISS, str(graphs), "0")  # fmt: skip


def compile_cap(check: Check) -> float:
    """The compiled SD line's seconds: `--compile-cap` if given, else what the budget has left less what the selected
    lines after it need, and never less than COMPILE_CAP."""
    if check.compile_cap is not None:
        return check.compile_cap
    later = LINES[[spec.run for spec in LINES].index(line_sd15_compiled) + 1 :]
    reserved = sum(spec.needs for spec in later if selected(check, spec))
    return max(COMPILE_CAP, check.remaining() - reserved - 5)


def child_sd15_compiled(check: Check, args: dict) -> dict:
    from bench.gpu_pipeline import compile_cache, compiled_adapters
    from bench.worker_harness import worker_images_per_second
    from model_worker.model.pipeline import DiffusionRunner

    sizes = check.sizes
    spec = sd15_spec(check, batch=sizes.compiled_batch)
    weights = Path(args["weights"])
    p = params(spec, sizes.steps, sizes.size)
    started = time.perf_counter()
    runner = DiffusionRunner(spec, weights, compile_unet=True, compile_cache=compile_cache(check.workdir, spec),
                             compile_backend="eager" if check.tiny else None)  # fmt: skip
    runner.warm_up()
    compile_s = time.perf_counter() - started
    check.log(f"compiled and warmed up in {compile_s:.0f}s")
    images = max(3 * spec.max_batch_size, int(sizes.seconds * 8) // spec.max_batch_size * spec.max_batch_size)
    worker = worker_images_per_second(runner, spec, p, spec.max_batch_size, images, warmup_images=spec.max_batch_size)
    check.log(f"compiled worker: {worker['images_per_s']:.2f} img/s")
    ranks = {"bench-ink": (1, 2), "bench-neon": (2, 4)} if check.tiny else None
    adapters = compiled_adapters(runner, spec, weights, check.workdir, p, calls=0 if check.tiny else 1, ranks=ranks)
    return {"compile_s": compile_s, "worker": worker, "adapters": adapters}


def line_warm_start(check: Check) -> None:
    """A fresh process, an empty inductor cache, only the saved artifacts: seconds from its start to its first answer."""
    spec = sd15_spec(check)
    _mode, refusal = compile_mode_or_refusal(check, spec)
    if refusal:
        check.add("sd15-compiled.warm-start", "SD-1.5-sized compiled, fresh process's first answer", MISS, refusal,
                  f"<= {WARM_START_SECONDS:.0f} s")  # fmt: skip
        return
    if not check.shared.get("compiled"):
        raise RuntimeError("no saved artifacts: the compiled line did not finish")
    weights = sd15_weights(check)
    name = "SD-1.5-sized compiled, fresh process's first answer from saved artifacts"
    cap = WARM_START_SECONDS + 10  # past the target the figure is a MISS whatever it is
    with tempfile.TemporaryDirectory(prefix="inductor-empty-") as empty:
        env = {"TORCHINDUCTOR_CACHE_DIR": empty, "TRITON_CACHE_DIR": empty}
        try:
            result = run_child(check, "warm-start", {"weights": str(weights), "launched": time.time()}, cap=cap,
                               env=env, in_process=False)  # fmt: skip
        except TimeoutError as exc:
            check.add("sd15-compiled.warm-start", name, check.judged(False), f"stopped: {exc}",
                      f"<= {WARM_START_SECONDS:.0f} s")  # fmt: skip
            return
    seconds = result["first_answer_s"]
    check.add("sd15-compiled.warm-start", name, check.judged(seconds <= WARM_START_SECONDS), f"{seconds:.0f} s",
              f"<= {WARM_START_SECONDS:.0f} s", **result)  # fmt: skip


def child_warm_start(check: Check, args: dict) -> dict:
    from bench.gpu_pipeline import compile_cache
    from model_worker.model.pipeline import DiffusionRunner
    from model_worker.model.runners import GenerationItem

    spec = sd15_spec(check, batch=check.sizes.compiled_batch)
    runner = DiffusionRunner(spec, Path(args["weights"]), compile_unet=True,
                             compile_cache=compile_cache(check.workdir, spec),
                             compile_backend="eager" if check.tiny else None)  # fmt: skip
    runner.warm_up()
    runner.generate([GenerationItem(prompt="first", seed=1)], params(spec, check.sizes.steps, check.sizes.size),
                    lambda step, total: None)  # fmt: skip
    check.sync()
    return {"first_answer_s": time.time() - args["launched"]}


# --- FLUX.1 [schnell] --------------------------------------------------------------------------------------


def line_flux_build(check: Check) -> None:
    result = run_child(check, "flux-build", {}, cap=110.0)
    check.shared["flux_weights"] = result["weights"]
    check.add("flux.build", f"FLUX.1 [schnell] {'tiny' if check.tiny else 'real size'}, random weights", INFO,
              f"ready in {result['seconds']:.0f} s", "reported")  # fmt: skip


def child_flux_build(check: Check, args: dict) -> dict:
    from bench.quantized_pipeline import weights_for

    started = time.perf_counter()
    weights = weights_for("flux", check.tiny, check.workdir)
    return {"weights": str(weights), "seconds": time.perf_counter() - started}


def flux_line(check: Check, kind: str | None, compiled: bool) -> None:
    from bench.quantized_pipeline import variant_spec

    label = kind or "bf16"
    key = f"flux.{label}{'-compiled' if compiled else ''}"
    steps = FLUX_TINY_STEPS if check.tiny else "4"
    name = f"FLUX.1 [schnell] {check.sizes.flux_size}², {steps} steps, {label}, {'compiled' if compiled else 'eager'}"
    spec = variant_spec("flux", kind, check.sizes.flux_size)
    if compiled:
        _mode, refusal = compile_mode_or_refusal(check, spec)
        if refusal:
            check.add(key, name, MISS, refusal, "s/image; memory within the plan")
            return
    if "flux_weights" not in check.shared:  # run alone (`--lines flux.bf16`): built (or found) first
        line_flux_build(check)
    row = run_child(check, "flux-variant", {"kind": kind, "compiled": compiled, "weights": check.shared["flux_weights"]},
                    cap=150.0 if compiled else 60.0)  # fmt: skip
    judge_variant(check, key, name, row, variant_plan("flux", kind, check.sizes.flux_size))


def judge_variant(check: Check, key: str, name: str, row: dict, plan: dict) -> None:
    """A measured variant's line: s/image, and on a GPU its memory loaded and at the peak against the plan."""
    target = f"loaded <= {plan['weights_gb']:.1f} GB x {PLAN_TOLERANCE}, peak <= {plan['total_gb']:.1f} GB (plan)"
    if "s_per_image" not in row:
        reason = row.get("refused") or row.get("out_of_memory") or "no figure"
        check.add(key, name, INFO if check.tiny and "refused" in row else MISS, f"not run: {reason}", target, **row)
        return
    measured = f"{row['s_per_image']:.2f} s/image"
    if "peak_gb" in row:
        measured += f", {row['loaded_gb']:.1f} GB loaded, {row['peak_gb']:.1f} GB peak"
        fits = row["loaded_gb"] <= plan["weights_gb"] * PLAN_TOLERANCE and row["peak_gb"] <= plan["total_gb"]
        result = PASS if fits else MISS
    else:
        measured += " (memory: GPU only)"
        result = INFO
    check.add(key, name, result, measured, target, **row, plan=plan)


def variant_plan(family: str, kind: str | None, size: int) -> dict:
    """The memory plan of the variant as the bench runs it (one image a call, at `size`)."""
    from bench.quantized_pipeline import variant_spec
    from contract.memory_plan import unit_plan

    spec = variant_spec(family, kind, size)
    limits = spec.limits.model_copy(update={"max_width": size, "max_height": size})
    plan = unit_plan(spec.model_copy(update={"limits": limits}))
    if plan is None:
        return {"weights_gb": float("nan"), "total_gb": float("nan")}
    return {"weights_gb": plan.weights_bytes / 1e9, "total_gb": plan.total_bytes / 1e9}


def child_flux_variant(check: Check, args: dict) -> dict:
    from bench.quantized_pipeline import measure

    steps = FLUX_TINY_STEPS if check.tiny else None  # None: the catalog's 4
    return measure("flux", args["kind"], args["compiled"], Path(args["weights"]), check.sizes.flux_size, steps,
                   check.sizes.flux_calls)  # fmt: skip


def line_flux_step_cache(check: Check, line: str = "flux.step-cache") -> None:
    """FLUX.1-[dev]-sized first_block (or taylorseer): [schnell]'s weights (the same transformer, only the guidance
    embedding [dev] adds is missing) in bf16, eager, one image a call, at [dev]'s 28 steps."""
    if "flux_weights" not in check.shared:
        line_flux_build(check)
    row = run_child(check, "flux-step-cache", {"weights": check.shared["flux_weights"], "line": line}, cap=180.0)
    kind = STEP_CACHE_SETTINGS[line]["kind"]
    add_step_cache_line(check, line, f"FLUX.1-[dev]-sized bf16 eager, {kind}", row)


def line_flux_taylorseer(check: Check) -> None:
    """FLUX.1-[dev]-sized TaylorSeer: the whole transformer skipped on a predicted step, each image's output its
    Taylor expansion (order 1) from its last full steps."""
    line_flux_step_cache(check, "flux.taylorseer")


def child_flux_step_cache(check: Check, args: dict) -> dict:
    from bench.quantized_pipeline import variant_spec
    from model_worker.model.pipeline import DiffusionRunner

    size = check.sizes.flux_size
    spec = step_cache_spec(check, variant_spec("flux", None, size), args.get("line", "flux.step-cache"))
    runner = DiffusionRunner(spec, Path(args["weights"]), torch_threads=2 if check.tiny else 0)
    return step_cache_times(check, runner, "flux", 1, size)


# --- SD 3.5 Large-sized step cache (issue 54) ----------------------------------------------------------------------

# The most seconds its child may run on a GPU: building 17.9 GB of random weights and writing them, loading them,
# and the warm and timed sets (two guided 28-step sets at 1024²).
SD35_STEP_CACHE_CAP = 420.0


def line_sd35_step_cache(check: Check) -> None:
    """SD-3.5-Large-sized first_block: its transformer (38 joint blocks), both CLIPs and the VAE at their real size,
    random weights, without T5 (zeros of its width in its place, as the catalog's `without: [text_encoder_3]` runs:
    the same tokens, so the same step), bf16, eager, one guided image (two rows, deciding together) at 1024², 28
    steps. Built in its child and deleted after: the disk is the families' after it."""
    import shutil

    try:
        row = run_child(check, "sd35-step-cache", {}, cap=SD35_STEP_CACHE_CAP)
    finally:
        shutil.rmtree(check.workdir / ("sd35-tiny" if check.tiny else "sd35-sized"), ignore_errors=True)
    add_step_cache_line(check, "sd35.step-cache", "SD-3.5-Large-sized bf16 eager, first_block", row)


def child_sd35_step_cache(check: Check, args: dict) -> dict:
    import shutil

    from bench.quantized_pipeline import variant_spec, weights_for
    from contract.memory_plan import unit_plan
    from model_worker.model.pipeline import DiffusionRunner

    size = check.sizes.flux_size
    entry = variant_spec("sd35", None, size).model_copy(update={"without": ["text_encoder_3"]})
    spec = step_cache_spec(check, entry, "sd35.step-cache")
    if not check.tiny and not (check.workdir / "sd35-sized" / "model_index.json").exists():
        needed = unit_plan(spec).weights_bytes / 1e9 + 1.0
        check.workdir.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(check.workdir).free / 1e9
        if free < needed:  # a clear MISS, not a disk filled part-way
            raise RuntimeError(f"its weights need {needed:.0f} GB of disk and {free:.0f} GB are free under "
                               f"{check.workdir}: run `--lines sd35` alone, or delete what is built there")  # fmt: skip
    started = time.perf_counter()
    weights = weights_for("sd35", check.tiny, check.workdir)
    built_s = time.perf_counter() - started
    check.log(f"SD-3.5-Large-sized weights ready in {built_s:.0f}s")
    runner = DiffusionRunner(spec, weights, torch_threads=2 if check.tiny else 0)
    return {**step_cache_times(check, runner, "sd35", 1, size), "weights_ready_s": built_s}


# --- The 2026 families: Z-Image-Turbo, FLUX.2 [klein] 4B, Qwen-Image ---------------------------------------------

# Each at its real size from the memory plan's recorded configurations, random weights, one image at the catalog's
# default steps and size (Qwen-Image: 50 steps at 1328x1328 with its true_cfg_scale), bf16 and float8 weight-only,
# eager: seconds per image, GB loaded and at the peak against the memory plan. Then its weights are deleted (a lent
# machine's 64 GiB disk holds FLUX.1's 34 GB beside Z-Image's or klein's, not beside Qwen-Image's 57.7 GB: a build
# checks the free disk first).
FAMILY_NAMES = {"zimage": "Z-Image-Turbo", "flux2-klein": "FLUX.2 [klein] 4B", "qwenimage": "Qwen-Image",
                "flux-fill": "FLUX.1 Fill [dev]", "flux-kontext": "FLUX.1 Kontext [dev]"}  # fmt: skip
# FLUX.1's inpaint and edit models (issue 51) run as the families do, at 1024² (their catalog's limit), an input image
# (and Fill's mask) of that size; their builds write only their transformer (23.8 GB), the rest linked from FLUX.1's.
FAMILY_SIZES = {"flux-fill": 1024, "flux-kontext": 1024}
FLUX_TOOL_TRANSFORMER_GB = 23.8
FAMILY_KINDS = (None, "float8_weight_only")
# The eager warm-up call's steps (its kernels and allocations are the timed call's; its image need not be whole).
FAMILY_WARMUP_STEPS = 2
# Seconds a line needs at least on a GPU, and the most its child may run: (build, variant) per family.
FAMILY_SECONDS = {"zimage": ((40.0, 200.0), (40.0, 240.0)), "flux2-klein": ((30.0, 150.0), (20.0, 150.0)),
                  "qwenimage": ((120.0, 400.0), (150.0, 560.0)), "flux-fill": ((40.0, 200.0), (40.0, 300.0)),
                  "flux-kontext": ((40.0, 200.0), (40.0, 300.0))}  # fmt: skip


def family_size(check: Check, family: str) -> int:
    from bench.quantized_pipeline import CATALOG_ENTRY
    from contract.catalog import load_catalog

    if check.tiny:
        return check.sizes.flux_size
    return FAMILY_SIZES.get(family) or load_catalog().get(CATALOG_ENTRY[family]).defaults.width


def line_family_build(check: Check, family: str) -> None:
    (_, cap), _ = FAMILY_SECONDS[family]
    result = run_child(check, "family-build", {"family": family}, cap=cap)
    check.shared[f"{family}_weights"] = result["weights"]
    check.add(f"{family}.build", f"{FAMILY_NAMES[family]} {'tiny' if check.tiny else 'real size'}, random weights",
              INFO, f"ready in {result['seconds']:.0f} s", "reported")  # fmt: skip


def child_family_build(check: Check, args: dict) -> dict:
    import shutil

    from bench.quantized_pipeline import weights_for

    family = args["family"]
    if not check.tiny and not (check.workdir / f"{family}-sized" / "model_index.json").exists():
        needed = variant_plan(family, None, family_size(check, family))["weights_gb"] + 1.0
        if family in FAMILY_SIZES and (check.workdir / "flux-sized" / "model_index.json").exists():
            needed = FLUX_TOOL_TRANSFORMER_GB + 1.0  # only the transformer is written: the rest is FLUX.1's, linked
        check.workdir.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(check.workdir).free / 1e9
        if free < needed:  # a clear MISS, not a disk filled part-way (FLUX.1's 34 GB may be there already)
            raise RuntimeError(f"its weights need {needed:.0f} GB of disk and {free:.0f} GB are free under "
                               f"{check.workdir}: run `--lines {family}` alone, or delete what is built there")  # fmt: skip
    started = time.perf_counter()
    weights = weights_for(family, check.tiny, check.workdir)
    return {"weights": str(weights), "seconds": time.perf_counter() - started}


def family_line(check: Check, family: str, kind: str | None) -> None:
    label = kind or "bf16"
    size = family_size(check, family)
    steps = FLUX_TINY_STEPS if check.tiny else "default"
    name = f"{FAMILY_NAMES[family]} {size}², {steps} steps, {label}, eager"
    if f"{family}_weights" not in check.shared:  # run alone (`--lines zimage.bf16`): built (or found) first
        line_family_build(check, family)
    _, (_, cap) = FAMILY_SECONDS[family]
    row = run_child(check, "family-variant", {"family": family, "kind": kind, "size": size,
                                              "weights": check.shared[f"{family}_weights"]}, cap=cap)  # fmt: skip
    judge_variant(check, f"{family}.{label}", name, row, variant_plan(family, kind, size))


def child_family_variant(check: Check, args: dict) -> dict:
    from bench.quantized_pipeline import measure

    steps = FLUX_TINY_STEPS if check.tiny else None  # None: the catalog's default
    return measure(args["family"], args["kind"], False, Path(args["weights"]), args["size"], steps, 1,
                   warmup_steps=None if check.tiny else FAMILY_WARMUP_STEPS)  # fmt: skip


def line_family_release(check: Check, family: str) -> None:
    """Deletes the family's built weights: the next family's need the disk."""
    import shutil

    weights = check.shared.pop(f"{family}_weights", None)
    if weights is not None:
        shutil.rmtree(weights, ignore_errors=True)
    check.add(f"{family}.release", f"{FAMILY_NAMES[family]} weights deleted", INFO, "freed" if weights else "none",
              "the disk for the next family")  # fmt: skip


def family_lines() -> list[LineSpec]:
    specs = []
    for family in FAMILY_NAMES:
        (build_needs, _), (variant_needs, _) = FAMILY_SECONDS[family]
        specs.append(LineSpec(f"{family}.build", lambda check, f=family: line_family_build(check, f), build_needs))
        for kind in FAMILY_KINDS:
            specs.append(LineSpec(f"{family}.{kind or 'bf16'}", lambda check, f=family, k=kind: family_line(check, f, k),
                                  variant_needs))  # fmt: skip
        specs.append(LineSpec(f"{family}.release", lambda check, f=family: line_family_release(check, f), 0.0))
    return specs


# --- running lines and children --------------------------------------------------------------------------------


@dataclass(frozen=True)
class LineSpec:
    key: str
    run: Callable[[Check], None]
    needs: float  # seconds it needs at least (GPU); skipped when less is left


def flux_lines() -> list[LineSpec]:
    specs = [LineSpec("flux.build", line_flux_build, 60.0)]
    for compiled in (False, True):
        for kind in FLUX_KINDS:
            label = f"flux.{kind or 'bf16'}{'-compiled' if compiled else ''}"
            specs.append(LineSpec(label, lambda check, k=kind, c=compiled: flux_line(check, k, c),
                                  90.0 if compiled else 30.0))  # fmt: skip
    return specs


LINES = [
    LineSpec("sd15.direct", line_direct, 20.0),
    LineSpec("sd15.worker-request", line_worker_request, 10.0),
    LineSpec("sd15.worker-step", line_worker_step, 10.0),
    LineSpec("sd15.lone", line_lone, 15.0),
    LineSpec("sd15.syncs", line_syncs, 5.0),
    LineSpec("sd15.scheduler-steps", line_scheduler_steps, 5.0),
    LineSpec("sd15.step-cache", line_sd15_step_cache, 10.0),
    LineSpec("sd15.controlnet", line_sd15_controlnet, 10.0),
    LineSpec("batch.interactive", line_batch_lines, 25.0),
    LineSpec("open-loop", line_open_loop, 45.0),
    LineSpec("release-sd15", release_sd15, 0.0),
    LineSpec("sd15-compiled", line_sd15_compiled, 60.0),
    LineSpec("sd15-compiled.warm-start", line_warm_start, WARM_START_SECONDS + 10),
    *flux_lines(),
    LineSpec("flux.step-cache", line_flux_step_cache, 40.0),
    LineSpec("flux.taylorseer", line_flux_taylorseer, 40.0),
    LineSpec("flux.controlnet", line_flux_controlnet, 30.0),
    LineSpec("sd35.step-cache", line_sd35_step_cache, 120.0),
    *family_lines(),
]
CHILDREN = {"sd15-compiled": child_sd15_compiled, "warm-start": child_warm_start, "flux-build": child_flux_build,
            "flux-variant": child_flux_variant, "family-build": child_family_build,
            "family-variant": child_family_variant, "flux-step-cache": child_flux_step_cache,
            "flux-controlnet": child_flux_controlnet, "sd35-step-cache": child_sd35_step_cache}  # fmt: skip


def run_child(check: Check, name: str, args: dict, cap: float, env: dict | None = None,
              in_process: bool | None = None) -> dict:  # fmt: skip
    """A line's work in a fresh process, killed at min(cap, what is left); its output streams through. On a CPU
    (tiny) it runs in this process unless `in_process` is False (the warm start must be a fresh process)."""
    if in_process if in_process is not None else check.tiny:
        return CHILDREN[name](check, args)
    timeout = max(1.0, min(cap, check.remaining() - 5))
    argv = [sys.executable, "-m", "bench.gpu_check", "--child", name, "--child-args", json.dumps(args),
            "--workdir", str(check.workdir), "--out", str(check.out), *(["--tiny"] if check.tiny else [])]  # fmt: skip
    process = subprocess.Popen(argv, cwd=ROOT, env={**os.environ, **(env or {})}, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)  # fmt: skip
    result: list[dict] = []
    tail: list[str] = []

    def relay() -> None:
        for line in process.stdout:
            if line.startswith("RESULT "):
                result.append(json.loads(line[len("RESULT ") :]))
            else:
                tail.append(line.rstrip())
                del tail[:-20]
                print(f"    {name}: {line.rstrip()}", flush=True)

    reader = threading.Thread(target=relay, daemon=True)
    reader.start()
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # the child's own session: it and what it started
        process.wait()
        raise TimeoutError(f"ran out of time after {timeout:.0f} s") from None
    except BaseException:  # the check itself stopped (SIGTERM, Ctrl-C): not a child left holding the GPU
        os.killpg(process.pid, signal.SIGKILL)
        raise
    finally:
        reader.join(timeout=10)
    if process.returncode != 0 or not result:
        last = next((line for line in reversed(tail) if line.strip()), "no output")
        raise RuntimeError(f"child exited {process.returncode}: {last[-300:]}")
    return result[-1]


def selected(check: Check, spec: LineSpec) -> bool:
    """Whether `--lines` selects this line: its key given, a line under one given (`sd15` selects `sd15.direct`, not
    `sd15-compiled`; `flux.bf16` not `flux.bf16-compiled`), or one given under it (the line a selected one needs)."""

    def under(key: str, name: str) -> bool:
        return key == name or key.startswith(name.rstrip(".") + ".")

    return not check.selected or any(under(spec.key, s) or under(s, spec.key) for s in check.selected)


def run_lines(check: Check, on_line: Callable[[], None] | None = None) -> None:
    """Each selected line in order, guarded; `on_line` after each (the results so far written: a run cut off
    still leaves them)."""
    for spec in LINES:
        if spec.run is release_sd15:  # whatever is selected: the lines after it need the GPU's memory
            release_sd15(check)
            continue
        if not selected(check, spec):
            continue
        left = check.remaining()
        needs = spec.needs if check.cuda else min(spec.needs, 2.0)
        if left < needs:
            check.add(spec.key, spec.key, MISS, f"skipped: {left:.0f} s of the budget left, it needs ~{needs:.0f} s",
                      "run within the budget")  # fmt: skip
            continue
        check.log(f"--- {spec.key} ({left:.0f} s left)")
        before = len(check.lines)
        try:
            spec.run(check)
        except Exception as exc:  # noqa: BLE001 - one line's failure is its MISS; the others still run
            reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
            check.add(spec.key, spec.key, MISS, f"error: {reason}", "runs", traceback=traceback.format_exc()[-3000:])
        if len(check.lines) == before:
            check.add(spec.key, spec.key, MISS, "no figure", "a figure")
        if on_line is not None:
            on_line()


def table(lines: list[Line]) -> str:
    rows = ["| result | line | measured | target |", "|---|---|---|---|"]
    rows += [f"| {line.result} | {line.name} | {line.measured} | {line.target} |" for line in lines]
    return "\n".join(rows)


def write(check: Check, versions: dict) -> None:
    check.out.mkdir(parents=True, exist_ok=True)
    counts = {r: sum(1 for line in check.lines if line.result == r) for r in (PASS, MISS, INFO)}
    document = {"device": check.device, "tiny": check.tiny, "seconds": time.monotonic() - check.started,
                "versions": versions, "counts": counts, "lines": [asdict(line) for line in check.lines]}  # fmt: skip
    (check.out / "gpu-check.json").write_text(json.dumps(document, indent=2, default=str))
    header = (f"# GPU check: {check.device}{' (tiny, CPU)' if check.tiny else ''}\n\n"
              f"{', '.join(f'{k} {v}' for k, v in versions.items())}; {document['seconds']:.0f} s; "
              f"{counts[PASS]} PASS, {counts[MISS]} MISS, {counts[INFO]} INFO\n\n")  # fmt: skip
    (check.out / "gpu-check.md").write_text(header + table(check.lines) + "\n")


def versions() -> dict:
    import torch

    found = {"python": sys.version.split()[0], "torch": torch.__version__}
    for name in ("diffusers", "transformers", "torchao"):
        try:
            found[name] = __import__(name).__version__
        except Exception:  # noqa: BLE001 - reported as absent
            found[name] = "absent"
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny sizes on a CPU (under two minutes)")
    parser.add_argument("--budget", type=float, help="seconds for the whole run (GPU 420, tiny 300)")
    parser.add_argument("--lines", nargs="+", help="only these lines and those under them (sd15: sd15.direct ...)")
    parser.add_argument("--compile-cap", type=float,
                        help="seconds for the compiled SD line (default: what the budget leaves after the lines "
                             f"selected after it, at least {COMPILE_CAP:.0f})")  # fmt: skip
    parser.add_argument("--workdir", type=Path, default=ROOT / ".gpu-bench", help="built weights, compile artifacts")
    parser.add_argument("--out", type=Path, help="results folder (bench/results/gpu-check, tiny: gpu-check-tiny)")
    parser.add_argument("--child", choices=sorted(CHILDREN), help=argparse.SUPPRESS)
    parser.add_argument("--child-args", default="{}", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from bench.client_stand_ins import install_if_missing

    stood_in = install_if_missing()
    out = args.out or ROOT / "bench" / "results" / ("gpu-check-tiny" if args.tiny else "gpu-check")
    import torch

    if not args.tiny and not torch.cuda.is_available():
        print("No CUDA GPU here: `make gpu-check TINY=1` runs the check at tiny sizes on a CPU.", flush=True)
        return 2
    budget = args.budget or DEFAULT_BUDGET["tiny" if args.tiny else "gpu"]
    check = Check(args.tiny, budget, args.workdir, out, args.lines, args.compile_cap)
    if args.child:
        result = CHILDREN[args.child](check, json.loads(args.child_args))
        print("RESULT " + json.dumps(result, default=str), flush=True)
        return 0
    found = versions()
    check.log(f"GPU check on {check.device}: {', '.join(f'{k} {v}' for k, v in found.items())}; budget {budget:.0f} s"
              + (f"; stand-ins for absent clients: {', '.join(stood_in)}" if stood_in else ""))  # fmt: skip
    # Stopped from outside (a device's time limit): SIGTERM becomes SystemExit, so a running child is stopped with
    # the check; the results so far are on disk already (written after each line).
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        run_lines(check, on_line=lambda: write(check, found))
    finally:
        write(check, found)
        print("\n" + table(check.lines), flush=True)
        print(f"\nresults: {check.out / 'gpu-check.md'} and gpu-check.json ({time.monotonic() - check.started:.0f} s)",
              flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
