"""Quantization at load (the catalog's `quantization:`) on the tiny SD 1.5 and FLUX.1 pipelines, on the CPU.

int8 weight-only quantizes the named components' Linear layers while diffusers loads them (torchao tensors in
the model, the weights on disk unchanged), and the worker's images stay within the docs' tolerance of the
unquantized pipeline's, in both schedulings, with an adapter (diffusers' LoRA layers on the quantized ones), and
compiled (torch.compile's eager backend, the adapter slots on quantized layers); FLUX.1 with its transformer and
T5 quantized likewise, with an adapter. torchao runs float8 weight-only
on a CPU too (within its own, wider tolerance); float8 dynamic it cannot run there, and fp8 on a GPU below compute
capability 8.9 (an A100): both are refused before anything loads, with the reason.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from contract.quantization import Quantization
from tests.unit.family_references import tiny_pipelines
from tests.unit.test_adapter_families import VISIBLE, denoiser_only, peft_file, reference_with
from tests.unit.test_adapter_parts import loaded_by_the_worker, with_adapters
from tests.unit.test_model_families import DEV, SD15, differences, reference_images
from tests.unit.test_step_scheduler import Worker, request

# The largest pixel difference (of 255) of a quantized model's image from the unquantized pipeline's: the docs'
# "Quantization at load" (docs/guides/quantization-and-compile.md, checked below). Measured on the tiny pipelines: int8 about 1-3, float8 weight-only about 6-10.
QUANTIZED_TOLERANCE = {"int8_weight_only": 6.0, "float8_weight_only": 16.0}
SIZE = 64
SPEC = SD15.model_copy(update={"name": "sd15-quantized"})
# FLUX.1 as the catalog quantizes it on an L4: the transformer and T5-XXL (transformers' T5EncoderModel).
FLUX = DEV.model_copy(update={"name": "flux-quantized", "adapters": SD15.adapters})


def quantized(kind: str, scheduling: str = "step", **update):
    quantization = Quantization(type=kind, components=["unet", "text_encoder"])
    return SPEC.model_copy(update={"quantization": quantization, "scheduling": scheduling, **update})


@pytest.fixture(scope="module")
def pipelines(tmp_path_factory) -> dict:
    """The tiny SD 1.5 and FLUX.1 [dev] pipelines' directories and the unquantized diffusers pipelines (the
    references)."""
    return tiny_pipelines(tmp_path_factory.mktemp("quantized"), {"sd15": SPEC, "flux-dev": FLUX})


def serve(runner, spec, request_id: str, adapters=None, images: int = 2) -> tuple[list, object]:
    pending = request(request_id, spec, steps=3, guidance=3.5, seed=7, images=images)
    pending.request.parameters.width = pending.request.parameters.height = SIZE
    if adapters is not None:
        pending = with_adapters(pending, adapters)
    with Worker({spec.queue: runner}) as worker:
        worker.pool.add(pending)
        worker.outcomes.wait(1)
    assert set(worker.outcomes.images) == {request_id}, worker.outcomes.answered
    return worker.outcomes.images[request_id], pending


def quantized_layers(model) -> tuple[int, int]:
    """(Linear layers whose weight is a torchao tensor, all Linear layers) of a model."""
    import torch
    from torchao.utils import TorchAOBaseTensor

    linear = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    return sum(isinstance(m.weight, TorchAOBaseTensor) for m in linear), len(linear)


def assert_within(kind: str, got: list, expected: list) -> float:
    difference = differences(got, expected)
    assert difference <= QUANTIZED_TOLERANCE[kind], f"{kind} differs from the unquantized image by {difference:.1f}"
    return difference


def test_int8_weight_only_stays_within_the_tolerance_in_both_schedulings_with_an_adapter(pipelines):
    from model_worker.model.pipeline import DiffusionRunner

    directory, _ = pipelines["sd15"]
    data = peft_file(directory, 1, 4)  # the UNet's and the text encoder's attention projections
    for scheduling in ("step", "request"):
        spec = quantized("int8_weight_only", scheduling)
        runner = DiffusionRunner(spec, directory, torch_threads=1)
        pipe = runner._pipeline  # noqa: SLF001
        for component in ("unet", "text_encoder"):
            done, total = quantized_layers(getattr(pipe, component))
            assert done == total > 0, f"{component}: {done} of {total} Linear layers quantized"
        assert quantized_layers(pipe.vae)[0] == 0, "the VAE is not in `components`: it keeps the serving dtype"
        base, pending = serve(runner, spec, f"int8-{scheduling}")
        assert assert_within("int8_weight_only", base, reference_images(pipelines, "sd15", pending)) > 0
        adapters, _ = loaded_by_the_worker(spec, "ink", data, directory)
        images, pending = serve(runner, spec, f"int8-ink-{scheduling}", adapters)
        assert_within(
            "int8_weight_only", images, reference_with(pipelines, "sd15", pending, {"ink": data}, {"ink": 1.0})
        )
        assert differences(images, base) > VISIBLE, "the adapter did not change the quantized model's image"


def test_flux_with_its_transformer_and_t5_in_int8_stays_within_the_tolerance_with_an_adapter(pipelines):
    from model_worker.model.pipeline import DiffusionRunner

    directory, _ = pipelines["flux-dev"]
    quantization = Quantization(type="int8_weight_only", components=["transformer", "text_encoder_2"])
    spec = FLUX.model_copy(update={"quantization": quantization, "scheduling": "step"})
    runner = DiffusionRunner(spec, directory, torch_threads=1)
    for component in ("transformer", "text_encoder_2"):
        done, total = quantized_layers(getattr(runner._pipeline, component))  # noqa: SLF001
        assert done == total > 0, f"{component}: {done} of {total} Linear layers quantized"
    base, pending = serve(runner, spec, "flux-int8")
    assert_within("int8_weight_only", base, reference_images(pipelines, "flux-dev", pending))
    data = peft_file(directory, 1, 4)  # the transformer's and the CLIP encoder's attention projections
    adapters, _ = loaded_by_the_worker(spec, "ink", data, directory)
    images, pending = serve(runner, spec, "flux-int8-ink", adapters)
    assert_within(
        "int8_weight_only", images, reference_with(pipelines, "flux-dev", pending, {"ink": data}, {"ink": 1.0})
    )
    assert differences(images, base) > VISIBLE


def test_float8_weight_only_runs_on_the_cpu_within_its_tolerance(pipelines):
    from model_worker.model.pipeline import DiffusionRunner

    directory, _ = pipelines["sd15"]
    spec = quantized("float8_weight_only", "request")
    runner = DiffusionRunner(spec, directory, torch_threads=1)
    assert quantized_layers(runner._pipeline.unet)[0] > 0  # noqa: SLF001
    images, pending = serve(runner, spec, "fp8-weight-only")
    assert_within("float8_weight_only", images, reference_images(pipelines, "sd15", pending))


def test_a_compiled_quantized_model_serves_the_base_and_an_adapter_without_compiling_after_its_warm_up(pipelines):
    """torch.compile's eager backend (Dynamo's tracing, no code generation): the adapter slots are made on the
    quantized layers before compiling, and the q/k/v projections are not fused (torchao's tensors cannot be
    concatenated)."""
    import torch
    from torch._dynamo.utils import counters

    from model_worker.model.pipeline import DiffusionRunner

    directory, _ = pipelines["sd15"]
    defaults = SPEC.defaults.model_copy(update={"width": SIZE, "height": SIZE})
    spec = quantized("int8_weight_only", max_batch_size=1, defaults=defaults)
    data = denoiser_only(peft_file(directory, 2, 4))
    torch._dynamo.reset()
    try:
        runner = DiffusionRunner(spec, directory, torch_threads=1, compile_unet=True, compile_backend="eager")
        runner.warm_up()
        graphs = counters["stats"]["unique_graphs"]
        base, pending = serve(runner, spec, "compiled-base", images=1)
        assert_within("int8_weight_only", base, reference_images(pipelines, "sd15", pending))
        adapters, _ = loaded_by_the_worker(spec, "neon", data, directory)
        images, pending = serve(runner, spec, "compiled-neon", adapters, images=1)
        assert_within(
            "int8_weight_only", images, reference_with(pipelines, "sd15", pending, {"neon": data}, {"neon": 1.0})
        )
        assert differences(images, base) > VISIBLE
        assert counters["stats"]["unique_graphs"] == graphs, "an adapter on the quantized model compiled again"
    finally:
        torch._dynamo.reset()


def test_float8_dynamic_on_the_cpu_is_refused_before_loading_with_the_reason(pipelines):
    from model_worker.model.pipeline import DiffusionRunner
    from model_worker.model.quantization import QuantizationUnsupportedError
    from model_worker.serving.service import WorkerService

    spec = quantized("float8_dynamic")
    with pytest.raises(QuantizationUnsupportedError, match=r"float8_dynamic runs only on a CUDA device of compute "
                                                            r"capability 8\.9 \(L4, H100\)"):  # fmt: skip
        DiffusionRunner(spec, pipelines["sd15"][0], torch_threads=1)
    # The worker checks before downloading the weights, and the error is not taken for unloadable weights.
    with pytest.raises(QuantizationUnsupportedError, match="sd15-quantized: quantization float8_dynamic"):
        WorkerService._download_and_load(SimpleNamespace(), spec)


@pytest.mark.parametrize(
    ("kind", "device", "capability", "refused"),
    [
        ("float8_weight_only", "cuda", (8, 0), "this GPU has 8.0"),  # A100
        ("float8_dynamic", "cuda", (8, 0), "this GPU has 8.0"),
        ("float8_dynamic", "cuda", (8, 9), None),  # L4
        ("float8_weight_only", "cuda", (9, 0), None),  # H100
        ("int8_weight_only", "cuda", (8, 0), None),
        ("int8_weight_only", "cpu", None, None),
        ("float8_weight_only", "cpu", None, None),
        ("float8_dynamic", "cpu", None, "no CPU kernel"),
    ],
)
def test_which_device_runs_which_quantization(kind, device, capability, refused):
    from model_worker.model.quantization import device_problem

    problem = device_problem(Quantization(type=kind, components=["transformer"]), device, capability)
    assert (problem is None) == (refused is None), problem
    if refused is not None:
        assert refused in problem


def test_a_component_the_weights_do_not_have_is_refused_naming_the_ones_they_have(pipelines):
    from model_worker.model.pipeline import DiffusionRunner
    from model_worker.model.quantization import QuantizationUnsupportedError

    spec = SPEC.model_copy(update={"quantization": Quantization(type="int8_weight_only", components=["transformer"])})
    with pytest.raises(QuantizationUnsupportedError, match=r"'transformer'.*quantizable: text_encoder, unet, vae"):
        DiffusionRunner(spec, pipelines["sd15"][0], torch_threads=1)


def test_a_quantized_model_keeps_its_compile_artifacts_apart_from_the_unquantized_ones():
    from model_worker.model.compiled import compile_cache_key

    int8, fp8 = quantized("int8_weight_only"), quantized("float8_weight_only")
    keys = {compile_cache_key(SPEC), compile_cache_key(int8), compile_cache_key(fp8)}
    assert len(keys) == 3 and compile_cache_key(int8).endswith("-int8_weight_only-text_encoder+unet")


def test_the_quantization_page_states_the_tolerances_this_test_holds_the_worker_to():
    page = (Path(__file__).resolve().parents[2] / "docs" / "guides" / "quantization-and-compile.md").read_text()
    assert f"**{QUANTIZED_TOLERANCE['int8_weight_only']:.0f}/255 per pixel**" in page
    assert f"**{QUANTIZED_TOLERANCE['float8_weight_only']:.0f}/255**" in page
