"""Compiled models (the catalog's `compile:`): the catalog's rules for modes and quantization, which mode a worker
serves a model in, the compile artifacts' key, the graph count the GPU check reads, and on the CPU one tiny
pipeline compiled by inductor in the `default` mode giving the eager model's images."""

from __future__ import annotations

import pytest

from contract.catalog import load_catalog
from contract.model_spec import ModelSpec
from contract.settings import Settings
from model_worker.model import compiled
from tests.unit.family_references import tiny_pipelines
from tests.unit.test_model_families import SD15, differences
from tests.unit.test_quantization import serve

# Inductor's fused kernels against eager on the CPU: float rounding only (measured: 0.0004 of 255).
COMPILED_TOLERANCE = 2.0


def _production_catalog():
    return load_catalog("contract/models.yaml")


def entry(name: str, **changes) -> dict:
    """The production catalog's entry as the YAML gives it (validated again with `changes`)."""
    data = _production_catalog().get(name).model_dump(exclude_unset=True)
    data.update(changes)
    return data


@pytest.mark.parametrize("name", ["flux-schnell", "sd35-txt2img"])
def test_the_catalog_keeps_fp8_on_the_l4_and_runs_it_compiled(name):
    spec = _production_catalog().get(name)
    assert spec.hardware == "l4" and spec.quantization.needs_float8
    assert spec.compile == "default"


@pytest.mark.parametrize("kind", ["float8_weight_only", "float8_dynamic"])
def test_fp8_without_compile_is_refused_and_int8_is_not(kind):
    quantization = {"backend": "torchao", "type": kind, "components": ["transformer", "text_encoder_2"]}
    with pytest.raises(ValueError, match=rf"flux-schnell: quantization {kind} runs compiled .* `compile: default`"):
        ModelSpec.model_validate(entry("flux-schnell", quantization=quantization, compile=None))
    accepted = ModelSpec.model_validate(entry("flux-schnell", quantization=quantization, compile="reduce-overhead"))
    assert accepted.compile == "reduce-overhead" and accepted.quantization.type == kind
    int8 = {**quantization, "type": "int8_weight_only"}
    assert ModelSpec.model_validate(entry("flux-schnell", quantization=int8, compile=None)).compile is None


def test_an_unknown_mode_and_compile_on_a_synthetic_runner_are_refused():
    with pytest.raises(ValueError, match="max-autotune-no-cudagraphs"):
        ModelSpec.model_validate(entry("flux-schnell", compile="max-autotune"))
    synthetic = load_catalog("contract/models.yaml", "contract/models.local.yaml").get("sleep").model_dump()
    with pytest.raises(ValueError, match="sleep: `compile` compiles a diffusers model's denoiser; the sleep runner"):
        ModelSpec.model_validate({**synthetic, "compile": "default"})


@pytest.mark.parametrize(
    ("catalog", "override", "expected"),
    [
        (None, None, None),  # eager unless the catalog says
        ("reduce-overhead", None, "reduce-overhead"),
        ("reduce-overhead", False, None),  # MAAS_TORCH_COMPILE=0: a rollback to eager
        (None, True, "default"),  # MAAS_TORCH_COMPILE=1: the affordable default where the catalog names none
        ("max-autotune-no-cudagraphs", True, "max-autotune-no-cudagraphs"),
    ],
)
def test_the_mode_a_worker_serves_follows_the_catalog_under_maas_torch_compile(catalog, override, expected):
    spec = SD15.model_copy(update={"compile": catalog})
    assert compiled.compile_mode(spec, override) == expected
    assert compiled.compile_mode(spec.model_copy(update={"runner": "sleep"}), override) is None


def test_maas_torch_compile_unset_follows_the_catalog():
    assert Settings.from_env({}).torch_compile is None
    assert Settings.from_env({"MAAS_TORCH_COMPILE": "0"}).torch_compile is False
    assert Settings.from_env({"MAAS_TORCH_COMPILE": "1"}).torch_compile is True


def test_compile_options_and_the_artifacts_key_carry_the_mode():
    assert compiled.compile_options(None, None) == {"mode": "default"}
    assert compiled.compile_options("reduce-overhead", None) == {"mode": "reduce-overhead"}
    assert compiled.compile_options("default", "inductor") == {"backend": "inductor", "mode": "default"}
    assert compiled.compile_options("reduce-overhead", "eager") == {"backend": "eager"}
    with pytest.raises(ValueError, match="max-autotune"):
        compiled.compile_options("max-autotune", None)
    keys = {compiled.compile_cache_key(SD15, mode) for mode in compiled.COMPILE_MODES}
    assert len(keys) == len(compiled.COMPILE_MODES)
    assert "-reduce-overhead" in compiled.compile_cache_key(SD15.model_copy(update={"compile": "reduce-overhead"}))


def test_graph_outputs_are_copied_out_of_a_cuda_graphs_pool():
    import torch

    sample = torch.ones(2)
    for output, read in [
        ((sample,), lambda copied: copied[0]),
        ({"sample": sample}, lambda copied: copied["sample"]),
        (sample, lambda copied: copied),
    ]:
        copied = read(compiled._copied(output))  # noqa: SLF001
        assert torch.equal(copied, sample) and copied.data_ptr() != sample.data_ptr()


def test_graphs_compiled_counts_each_new_graph_and_nothing_for_a_repeat():
    import torch

    torch._dynamo.reset()
    try:
        model = compiled.compile_model(torch.nn.Linear(4, 4), "default", backend="eager")
        before = compiled.graphs_compiled()
        model(torch.ones(2, 4))
        assert compiled.graphs_compiled() == before + 1
        model(torch.zeros(2, 4))  # the same shape: the same graph
        assert compiled.graphs_compiled() == before + 1
        model(torch.ones(4, 4))  # a new static shape: one more graph
        assert compiled.graphs_compiled() == before + 2
    finally:
        torch._dynamo.reset()


def test_a_tiny_pipeline_compiled_by_inductor_in_the_default_mode_gives_the_eager_images(tmp_path_factory):
    """One small case (inductor compiles for minutes on a CPU): the tiny SD 1.5, one image a call, request-level."""
    import torch

    from model_worker.model.pipeline import DiffusionRunner

    spec = SD15.model_copy(update={"name": "sd15-compiled", "scheduling": "request", "max_batch_size": 1,
                                   "adapters": None, "compile": "default",
                                   "defaults": SD15.defaults.model_copy(update={"width": 64, "height": 64})})  # fmt: skip
    directory, _ = tiny_pipelines(tmp_path_factory.mktemp("compiled"), {"sd15": spec})["sd15"]
    eager = DiffusionRunner(spec, directory, torch_threads=1)
    expected, _ = serve(eager, spec, "tiny", images=1)  # the id is in the prompt: the same request
    torch._dynamo.reset()
    try:
        runner = DiffusionRunner(spec, directory, torch_threads=1, compile_unet=True, compile_backend="inductor")
        assert runner.compile_mode == "default"
        runner.warm_up()
        graphs = compiled.graphs_compiled()
        images, _ = serve(runner, spec, "tiny", images=1)
        assert compiled.graphs_compiled() == graphs, "a request compiled after the warm-up"
    finally:
        torch._dynamo.reset()
    assert differences(images, expected) <= COMPILED_TOLERANCE


def test_reduce_overhead_marks_each_call_a_new_graph_step_and_copies_its_outputs(monkeypatch):
    """On a CPU inductor skips the CUDA graphs themselves; the hooks around the compiled model run all the same."""
    import torch

    marks, copies = [], []
    copy = compiled._copied  # noqa: SLF001
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(1))
    monkeypatch.setattr(compiled, "_copied", lambda output: copies.append(1) or copy(output))
    torch._dynamo.reset()
    try:
        model = compiled.compile_model(torch.nn.Linear(4, 4), "reduce-overhead")
        with torch.inference_mode():
            for _ in range(2):
                model(torch.ones(2, 4))
        assert len(marks) == len(copies) == 2
        plain = compiled.compile_model(torch.nn.Linear(4, 4), "default", backend="eager")
        plain(torch.ones(2, 4))
        assert len(marks) == len(copies) == 2, "only reduce-overhead copies its outputs"
    finally:
        torch._dynamo.reset()
