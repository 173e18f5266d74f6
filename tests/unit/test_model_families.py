"""Every model family against its own reference, the diffusers pipeline: the worker's images equal the pipeline's.

For SD 1.5, SDXL, FLUX.1 [schnell] and [dev] and SD 3.5 (tiny random-weight pipelines built from configuration,
as the local stack serves them; the UNets' timestep made to matter, `family_references.UNET_SHARPENING`), a
request's images made by the worker's device loop, alone and in a running set beside requests with other step
counts and guidance, in both schedulings, equal what the pipeline itself returns for the same prompt, seed and
parameters, within the docs' tolerance (docs/guides/model-families.md). And the oracle can tell: a worker broken on purpose (every row given
the first row's timestep, a zero timestep, no guidance, a wrong schedule shift) misses it by far more.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from emulators.stack import local_catalog
from tests.unit.family_references import tiny_pipelines
from tests.unit.test_step_scheduler import Hooked, Worker, request

CATALOG = local_catalog(test_fixtures=True)
SDXL = CATALOG.get("sdxl-txt2img")
SCHNELL = CATALOG.get("flux-schnell")
DEV = SCHNELL.model_copy(update={"name": "flux-dev", "guidance": "embedded"})
SD15 = CATALOG.get("sd15-txt2img")
SD35 = CATALOG.get("sd35-txt2img")
SD35_NO_T5 = SD35.model_copy(update={"name": "sd35-no-t5", "without": ["text_encoder_3"]})
SDXL_IMG2IMG = SDXL.model_copy(update={"name": "sdxl-img2img", "task": "image-to-image",
                                       "pipeline": "StableDiffusionXLImg2ImgPipeline"})  # fmt: skip
FLUX_IMG2IMG = DEV.model_copy(update={"name": "flux-img2img", "task": "image-to-image",
                                      "pipeline": "FluxImg2ImgPipeline"})  # fmt: skip
SD15_IMG2IMG = CATALOG.get("sd15-img2img")
ZIMAGE = CATALOG.get("z-image-turbo")
ZIMAGE_IMG2IMG = CATALOG.get("z-image-img2img")
KLEIN = CATALOG.get("flux2-klein")
# Its catalog batch (2 images on an H100) is below the running set's three images sharing a call.
QWEN = CATALOG.get("qwen-image").model_copy(update={"max_batch_size": 4, "max_instances_per_request": 4})
QWEN_IMG2IMG = CATALOG.get("qwen-image-img2img").model_copy(
    update={"max_batch_size": 4, "max_instances_per_request": 4}
)
FAMILIES = {
    "sd15": SD15, "sdxl": SDXL, "flux-schnell": SCHNELL, "flux-dev": DEV, "sd35": SD35, "sd35-no-t5": SD35_NO_T5,
    "sd15-img2img": SD15_IMG2IMG, "sdxl-img2img": SDXL_IMG2IMG, "flux-img2img": FLUX_IMG2IMG,
    "z-image-turbo": ZIMAGE, "flux2-klein": KLEIN, "qwen-image": QWEN, "z-image-img2img": ZIMAGE_IMG2IMG,
    "qwen-image-img2img": QWEN_IMG2IMG,
}  # fmt: skip
# A different batch composition moves pixel values by float rounding only (measured: under 0.002/255 for every
# family here); half precision moves them more (FLOAT16_TOLERANCE: the float16 SDXL case, 1.5/255 measured).
PIXEL_TOLERANCE = 1
FLOAT16_TOLERANCE = 3
SIZE = 64  # a multiple of 16, so every family takes it


@pytest.fixture(scope="module")
def pipelines(tmp_path_factory) -> dict:
    """Per family: the directory of its tiny pipeline and the diffusers pipeline loaded from it (the reference)."""
    return tiny_pipelines(tmp_path_factory.mktemp("families"), FAMILIES)


def runner_for(pipelines, name: str, scheduling: str):
    from model_worker.model.pipeline import DiffusionRunner

    spec = FAMILIES[name].model_copy(update={"scheduling": scheduling})
    return spec, DiffusionRunner(spec, pipelines[name][0], torch_threads=1)


def reference_images(pipelines, name: str, pending) -> list:
    """The pipeline's own output for this request: one call per image, its own generator, as a client would."""
    import torch

    spec = FAMILIES[name]
    params = pending.request.parameters
    images = []
    for item in pending.items:
        kwargs = {
            "prompt": item.prompt, "num_inference_steps": params.num_inference_steps,
            "guidance_scale": params.guidance_scale, "width": params.width, "height": params.height,
            "generator": torch.Generator().manual_seed(item.seed), "output_type": "np",
        }  # fmt: skip
        if item.negative_prompt is not None:
            kwargs["negative_prompt"] = item.negative_prompt
        if spec.family.name == "qwenimage":  # its model card's call: true_cfg_scale, with " " as the negative prompt
            kwargs["true_cfg_scale"], kwargs["guidance_scale"] = kwargs["guidance_scale"], None
            if kwargs["true_cfg_scale"] > 1:
                kwargs.setdefault("negative_prompt", " ")
        if spec.family.name == "flux" and spec.guidance_mode == "none":
            kwargs["max_sequence_length"] = 256  # [schnell]'s T5 length, as its reference code and model card run it
        if spec.task == "image-to-image":
            kwargs["image"], kwargs["strength"] = item.image, params.strength
            if spec.family.name in ("sd15", "sdxl"):  # the UNet img2img pipelines take the image's size
                del kwargs["width"], kwargs["height"]
        images.append(pipelines[name][1](**kwargs).images[0])
    return images


def differences(got: list, expected: list) -> float:
    """The largest pixel difference (of 255) between two requests' images."""
    assert len(got) == len(expected)
    return max(
        np.abs(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)).max() * 255
        for a, b in zip(got, expected, strict=True)
    )


def assert_close(got: list, expected: list, tolerance: float = PIXEL_TOLERANCE) -> None:
    difference = differences(got, expected)
    assert difference <= tolerance, f"differs from the pipeline's own image by {difference:.1f}/255"


def input_image(seed: int):
    """A small input image of smooth colors (an image-to-image request's `image`)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    corners = rng.integers(0, 255, (2, 2, 3)).astype(np.float64)
    ys, xs = np.mgrid[0:SIZE, 0:SIZE] / (SIZE - 1)
    top = corners[0, 0] * (1 - xs[..., None]) + corners[0, 1] * xs[..., None]
    bottom = corners[1, 0] * (1 - xs[..., None]) + corners[1, 1] * xs[..., None]
    return Image.fromarray((top * (1 - ys[..., None]) + bottom * ys[..., None]).astype(np.uint8))


def make_request(name: str, request_id: str, spec, **kwargs):
    """`request` with what the family needs: an input image and a strength for image-to-image."""
    if spec.task == "image-to-image":
        kwargs.setdefault("image", input_image(kwargs.get("seed", 1)))
        kwargs.setdefault("strength", 0.6)
    return request(request_id, spec, **kwargs)


def guidance_of(name: str, value: float) -> float:
    """A guidance scale the family takes: [schnell] takes none (the API refuses one), the others any."""
    return 0.0 if FAMILIES[name].guidance_mode == "none" else value


@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_request_alone_equals_the_pipeline_in_both_schedulings(pipelines, name):
    for scheduling in ("step", "request"):
        spec, runner = runner_for(pipelines, name, scheduling)
        pending = make_request(name, f"alone-{scheduling}", spec, steps=4, guidance=guidance_of(name, 3.5), seed=7,
                               images=2)  # fmt: skip
        pending.request.parameters.width = pending.request.parameters.height = SIZE
        with Worker({spec.queue: runner}) as worker:
            worker.pool.add(pending)
            worker.outcomes.wait(1)
        assert set(worker.outcomes.images) == {pending.request_id}, worker.outcomes.answered
        assert_close(worker.outcomes.images[pending.request_id], reference_images(pipelines, name, pending))


def running_set(name: str, spec) -> tuple:
    """The running set every family's oracle is checked on: a guided request of 6 steps and, from its second call
    on, an unguided one of 3 steps (two images) beside it, so the two are at other timesteps in every shared call
    and a guided and an unguided image share each call."""
    first = make_request(name, "first", spec, steps=6, guidance=guidance_of(name, 6.0), seed=3)
    joiner = make_request(name, "joiner", spec, steps=3, guidance=guidance_of(name, 1.0), seed=9, images=2)
    for pending in (first, joiner):
        pending.request.parameters.width = pending.request.parameters.height = SIZE
    return first, joiner


def serve_running_set(runner, first, joiner) -> tuple[list[int], dict]:
    """Runs the running set through the worker's device loop: (the images of each model call, the outcomes)."""
    hooked = Hooked(runner)
    with Worker({runner.spec.queue: hooked}) as worker:
        hooked.after[1] = lambda: worker.pool.add(joiner)
        worker.pool.add(first)
        worker.outcomes.wait(2)
    assert set(worker.outcomes.images) == {"first", "joiner"}, worker.outcomes.answered
    return hooked.sizes, worker.outcomes


class RunningSetOracle:
    """Per family, made on first use and shared by the oracle test and its mutation checks: the worker's step
    runner and the pipeline's own images of the running set."""

    def __init__(self, pipelines) -> None:
        self.pipelines = pipelines
        self._made: dict[str, tuple] = {}

    def runner(self, name: str):
        return self._case(name)[0]

    def difference(self, name: str, outcomes) -> float:
        """The largest difference of the served running set's images from the pipeline's own."""
        expected = self._case(name)[1]
        return max(differences(outcomes.images[key], images) for key, images in expected.items())

    def _case(self, name: str) -> tuple:
        if name not in self._made:
            spec, runner = runner_for(self.pipelines, name, "step")
            expected = {p.request_id: reference_images(self.pipelines, name, p) for p in running_set(name, spec)}
            self._made[name] = (runner, expected)
        return self._made[name]


@pytest.fixture(scope="module")
def oracle(pipelines) -> RunningSetOracle:
    return RunningSetOracle(pipelines)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_requests_with_other_steps_and_guidance_share_steps_and_each_equals_the_pipeline(oracle, name):
    runner = oracle.runner(name)
    sizes, outcomes = serve_running_set(runner, *running_set(name, runner.spec))
    assert max(sizes) == 3, f"the joiner never shared a model call: {sizes}"
    assert outcomes.fields["first"]["batch_id"] == outcomes.fields["joiner"]["batch_id"]
    difference = oracle.difference(name, outcomes)
    assert difference <= PIXEL_TOLERANCE, f"differs from the pipeline's own images by {difference:.1f}/255"


# --- the oracle sees a wrong worker --------------------------------------------------------------------------
# Each check breaks the worker on purpose and asserts that the running set's comparison with the pipeline then
# fails, by far more than the tolerance: an oracle that passes a wrong timestep, guidance or shift proves nothing.
MUTATION_MARGIN = 9  # /255: nine times the tolerance the oracles held when it was 3


def model_call_with_timesteps(model, change):
    """The worker's model, with `change` applied to the per-row timesteps of every call."""
    import inspect

    forward = model.forward
    signature = inspect.signature(forward)
    name = "timestep" if "timestep" in signature.parameters else "t"  # Z-Image's transformer names it `t`

    def mutated(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.arguments[name] = change(bound.arguments[name])
        return forward(*bound.args, **bound.kwargs)

    return mutated


def first_items_timestep(monkeypatch, runner) -> None:
    """Every row of a shared call gets the first row's timestep (a batch that ignores per-sample timesteps)."""
    model = runner._denoiser.model
    monkeypatch.setattr(model, "forward", model_call_with_timesteps(model, lambda t: t[:1].expand(t.shape[0])))


def zero_timestep(monkeypatch, runner) -> None:
    import torch

    model = runner._denoiser.model
    monkeypatch.setattr(model, "forward", model_call_with_timesteps(model, torch.zeros_like))


def no_guidance(monkeypatch, runner) -> None:
    """Each guided image is denoised at guidance 1: classifier-free guidance's text row alone, FLUX [dev]'s embedded
    guidance of 1."""
    start_items = runner.start_items

    def started(items, params):
        running = start_items(items, params)
        for r in running:
            if r.state["guidance"] is not None:
                r.state["guidance"] = 1.0
        return running

    monkeypatch.setattr(runner, "start_items", started)


def wrong_shift(monkeypatch, runner) -> None:
    """Each image's flow-matching schedule is shifted wrongly: FLUX's `mu` as for an image of another size (+0.5),
    SD 3.5's static shift doubled."""
    import functools

    from model_worker.model.families.base import Denoiser

    new_scheduler = Denoiser.new_scheduler

    def shifted(self):
        scheduler = new_scheduler(self)
        if not scheduler.config.get("use_dynamic_shifting"):
            scheduler.set_shift(scheduler.shift * 2)
            return scheduler
        set_timesteps = scheduler.set_timesteps

        @functools.wraps(set_timesteps)  # diffusers' retrieve_timesteps reads its signature
        def with_mu(*args, mu=None, **kwargs):
            return set_timesteps(*args, mu=mu + 0.5, **kwargs)

        scheduler.set_timesteps = with_mu
        return scheduler

    monkeypatch.setattr(Denoiser, "new_scheduler", shifted)


MUTATIONS = {
    "first-items-timestep": first_items_timestep, "zero-timestep": zero_timestep, "no-guidance": no_guidance,
    "wrong-shift": wrong_shift,
}  # fmt: skip
MUTATED = [
    (name, mutation)
    for name in ("sd15", "sdxl", "flux-schnell", "flux-dev", "sd35", "z-image-turbo", "flux2-klein", "qwen-image")
    for mutation in MUTATIONS
    if not (mutation == "no-guidance" and FAMILIES[name].guidance_mode == "none")  # [schnell] takes no guidance
    and not (mutation == "wrong-shift" and FAMILIES[name].family.name in ("sd15", "sdxl"))  # no shift
]


@pytest.mark.parametrize(("name", "mutation"), MUTATED)
def test_a_worker_with_a_wrong_timestep_guidance_or_shift_fails_the_oracle(oracle, monkeypatch, name, mutation):
    runner = oracle.runner(name)
    MUTATIONS[mutation](monkeypatch, runner)
    _, outcomes = serve_running_set(runner, *running_set(name, runner.spec))
    difference = oracle.difference(name, outcomes)
    assert difference > MUTATION_MARGIN, f"the oracle passed a worker with {mutation}: off by {difference:.1f}/255"


def test_a_float16_sdxl_decodes_through_the_float32_upcast_as_the_pipeline_does(pipelines):
    """SDXL in float16, as a GPU serves it (`gpu_dtype`), on CPU: its VAE's config says it overflows in half
    precision (`force_upcast`), so both the worker and the pipeline decode in float32 and put the VAE back."""
    import diffusers
    import torch

    directory = pipelines["sdxl"][0]
    reference = diffusers.StableDiffusionXLPipeline.from_pretrained(directory, torch_dtype=torch.float16)
    reference.set_progress_bar_config(disable=True)
    spec, runner = runner_for(pipelines, "sdxl", "step")
    vae = runner._pipeline.to(torch.float16).vae
    assert vae.config.force_upcast
    decoded = []
    decode = vae.decode

    def recording_decode(latents, *args, **kwargs):
        decoded.append((latents.dtype, vae.dtype))
        return decode(latents, *args, **kwargs)

    vae.decode = recording_decode
    first, joiner = running_set("sdxl", spec)
    _, outcomes = serve_running_set(runner, first, joiner)
    assert decoded and set(decoded) == {(torch.float32, torch.float32)}, decoded
    assert vae.dtype == torch.float16, "the VAE must be half precision again after the decode"
    for pending in (first, joiner):
        expected = reference_images({"sdxl": (directory, reference)}, "sdxl", pending)
        assert_close(outcomes.images[pending.request_id], expected, FLOAT16_TOLERANCE)


@pytest.mark.parametrize(
    ("name", "runs"),
    [("sd15-img2img", 3), ("sdxl-img2img", 3), ("flux-img2img", 4), ("z-image-img2img", 4), ("qwen-image-img2img", 4)],
)
def test_image_to_image_progress_counts_the_steps_its_pipeline_runs_in_both_schedulings(pipelines, name, runs):
    """7 steps at strength 0.5: SD's and SDXL's img2img pipelines run int(3.5) = 3 of them, FLUX's 7 - int(3.5) = 4;
    progress shows that many, whatever the scheduler adds (PNDM's extra call)."""
    for scheduling in ("step", "request"):
        spec, runner = runner_for(pipelines, name, scheduling)
        pending = make_request(name, f"progress-{scheduling}", spec, steps=7, guidance=guidance_of(name, 3.5),
                               strength=0.5)  # fmt: skip
        pending.request.parameters.width = pending.request.parameters.height = SIZE
        with Worker({spec.queue: runner}) as worker:
            worker.pool.add(pending)
            worker.outcomes.wait(1)
        seen = worker.progress.seen[pending.request_id]
        assert {total for _, total in seen} == {runs} and max(seen) == (runs, runs), (scheduling, sorted(seen))


def test_flux_requests_of_different_sizes_never_share_a_call_and_keep_their_own_shift(pipelines):
    spec, runner = runner_for(pipelines, "flux-schnell", "step")
    hooked = Hooked(runner)
    small = request("small", spec, steps=4, guidance=0.0, seed=1)
    large = request("large", spec, steps=4, guidance=0.0, seed=2)
    small.request.parameters.width = small.request.parameters.height = 32
    large.request.parameters.width = large.request.parameters.height = 128
    started = {}
    start_items = runner.start_items

    def recording_start(items, params):
        running = start_items(items, params)
        started[(params.width, params.height)] = running[0].state["mu"]
        return running

    runner.start_items = recording_start
    with Worker({spec.queue: hooked}) as worker:
        hooked.after[1] = lambda: worker.pool.add(large)
        worker.pool.add(small)
        worker.outcomes.wait(2)
    assert max(hooked.sizes) == 1, f"images of two sizes shared a transformer call: {hooked.sizes}"
    assert started[(32, 32)] < started[(128, 128)], "the schedule shift must grow with the image's token count"
    assert worker.outcomes.fields["small"]["batch_id"] != worker.outcomes.fields["large"]["batch_id"]
    for pending in (small, large):
        assert_close(worker.outcomes.images[pending.request_id], reference_images(pipelines, "flux-schnell", pending))


@pytest.mark.parametrize(("name", "tokens"), [("flux-schnell", 256), ("flux-dev", 512)])
def test_flux_schnell_runs_256_t5_tokens_and_dev_512_as_their_references_do(pipelines, monkeypatch, name, tokens):
    """[schnell] was distilled with a 256-token T5 prompt (its reference code and model card run 256), [dev] with
    512: the transformer sees that many text tokens in both schedulings. The tiny T5 pads alike, so the images
    alone would not tell."""
    for scheduling in ("step", "request"):
        spec, runner = runner_for(pipelines, name, scheduling)
        model, seen = runner._denoiser.model, set()
        forward = model.forward

        def recording(*args, _forward=forward, _seen=seen, **kwargs):
            _seen.add(kwargs["encoder_hidden_states"].shape[1])
            return _forward(*args, **kwargs)

        monkeypatch.setattr(model, "forward", recording)
        pending = make_request(name, f"tokens-{scheduling}", spec, steps=1, guidance=guidance_of(name, 3.5))
        pending.request.parameters.width = pending.request.parameters.height = SIZE
        with Worker({spec.queue: runner}) as worker:
            worker.pool.add(pending)
            worker.outcomes.wait(1)
        assert seen == {tokens}, (scheduling, seen)


def test_a_flux_catalog_entry_whose_guidance_contradicts_the_weights_is_refused_at_load(pipelines):
    from model_worker.model.pipeline import DiffusionRunner

    wrong = SCHNELL.model_copy(update={"guidance": "embedded"})
    with pytest.raises(ValueError, match="guidance 'embedded'.*'none'"):
        DiffusionRunner(wrong, pipelines["flux-schnell"][0], torch_threads=1)


@pytest.mark.parametrize("name", ["sd15", "sdxl", "sd35", "sd35-no-t5", "qwen-image"])
def test_a_negative_prompt_shares_steps_with_a_request_without_one_and_both_equal_the_pipeline(pipelines, name):
    from dataclasses import replace

    spec, runner = runner_for(pipelines, name, "step")
    hooked = Hooked(runner)
    plain = make_request(name, "plain", spec, steps=4, guidance=5.0, seed=4)
    negative = make_request(name, "negative", spec, steps=4, guidance=5.0, seed=4)
    # The same prompt and seed: only the negative prompt differs.
    negative.items[0] = replace(plain.items[0], negative_prompt="fog and blur")
    with Worker({spec.queue: hooked}) as worker:
        hooked.after[1] = lambda: worker.pool.add(negative)
        worker.pool.add(plain)
        worker.outcomes.wait(2)
    assert max(hooked.sizes) == 2
    images = worker.outcomes.images
    for pending in (plain, negative):
        assert_close(images[pending.request_id], reference_images(pipelines, name, pending))
    difference = np.abs(np.asarray(images["plain"][0]) - np.asarray(images["negative"][0])).max() * 255
    assert difference > PIXEL_TOLERANCE, "the negative prompt changed nothing"


def test_the_families_page_states_the_tolerance_this_test_holds_the_worker_to():
    page = (Path(__file__).resolve().parents[2] / "docs" / "guides" / "model-families.md").read_text()
    assert f"**within {PIXEL_TOLERANCE}/255 per pixel**" in page
