"""Diffusers' attention without its per-call `inspect.signature`: the same outputs, bit for bit, no introspection in
a model call, and a call with keyword arguments still goes through diffusers' own forward (model/attention.py)."""

from __future__ import annotations

import inspect

import pytest

from model_worker.model.attention import without_attention_introspection


@pytest.fixture(scope="module")
def pipelines(tmp_path_factory) -> dict:
    import diffusers

    from emulators.tiny_pipeline import build_pipeline

    root = tmp_path_factory.mktemp("attention")
    built = {}
    for name in ("StableDiffusionPipeline", "FluxPipeline"):
        built[name] = getattr(diffusers, name).from_pretrained(build_pipeline(root / name, name))
    return built


def model_call(pipeline):
    """One call of the pipeline's denoiser on fixed inputs."""
    import torch

    generator = torch.Generator().manual_seed(0)
    if hasattr(pipeline, "unet"):
        unet = pipeline.unet
        sample = torch.randn(2, unet.config.in_channels, 8, 8, generator=generator)
        context = torch.randn(2, 7, unet.config.cross_attention_dim, generator=generator)
        return lambda: unet(sample, torch.tensor([500, 20]), encoder_hidden_states=context, return_dict=False)[0]
    transformer = pipeline.transformer
    config = transformer.config
    tokens, text = 16, 5
    inputs = {
        "hidden_states": torch.randn(1, tokens, config.in_channels, generator=generator),
        "encoder_hidden_states": torch.randn(1, text, config.joint_attention_dim, generator=generator),
        "pooled_projections": torch.randn(1, config.pooled_projection_dim, generator=generator),
        "timestep": torch.tensor([0.5]),
        "img_ids": torch.zeros(tokens, 3),
        "txt_ids": torch.zeros(text, 3),
        "return_dict": False,
    }
    return lambda: transformer(**inputs)[0]


def counted_signatures(call, monkeypatch) -> tuple[object, int]:
    """The call's output and how many times `inspect.signature` ran during it."""
    calls = []
    signature = inspect.signature

    def counting(*args, **kwargs):
        calls.append(args)
        return signature(*args, **kwargs)

    monkeypatch.setattr(inspect, "signature", counting)
    try:
        return call(), len(calls)
    finally:
        monkeypatch.setattr(inspect, "signature", signature)


@pytest.mark.parametrize("name", ["StableDiffusionPipeline", "FluxPipeline"])
def test_a_model_call_gives_the_same_output_without_introspecting(pipelines, name, monkeypatch):
    import torch

    pipeline = pipelines[name]
    call = model_call(pipeline)
    with torch.inference_mode():
        before, introspected = counted_signatures(call, monkeypatch)
        assert introspected > 0  # diffusers' own forward: one a module a call
        changed = without_attention_introspection(pipeline)
        after, introspected = counted_signatures(call, monkeypatch)
    assert changed > 0 and introspected == 0
    assert torch.equal(before, after)
    assert without_attention_introspection(pipeline) == 0  # once only: a shared component is left as it is


def test_a_call_with_keyword_arguments_goes_through_diffusers_own_forward(pipelines, caplog):
    import torch
    from diffusers.models.attention_processor import Attention

    attention = next(m for m in pipelines["StableDiffusionPipeline"].unet.modules() if type(m) is Attention)
    without_attention_introspection(pipelines["StableDiffusionPipeline"])
    hidden = torch.randn(1, 4, attention.query_dim, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        plain = attention(hidden)
        unexpected = attention(hidden, not_a_processor_argument=1.0)
    assert torch.equal(plain, unexpected)
    assert "not_a_processor_argument" in caplog.text  # diffusers' warning, from its forward
