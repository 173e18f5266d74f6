"""bench/gpu_pipeline.py's `--quantization` comparison: the worker's runner in the serving dtype and quantized at load
(the catalog's `quantization:` types), eager and compiled, one image per call at `--size`: seconds per image, and
on CUDA the memory allocated once loaded and the peak of a call.

`--family flux` builds FLUX.1 [schnell] at its real size from configuration, random weights, saved once as bf16
safetensors (no download): the transformer's defaults in diffusers are FLUX.1's (19 double and 38 single blocks,
24 heads of 128, joint attention 4096: about 11.9 B parameters, 23.8 GB), T5-XXL (24 layers, d_model 4096, d_ff
10240, 64 heads: 4.8 B, 9.5 GB), CLIP-L (12 layers of 768) and the 16-channel VAE; the tokenizers are the tiny
pipelines' (the models' vocabularies keep the real sizes). The catalog's `flux-schnell` entry quantizes the
transformer and T5 (`COMPONENTS`). `--tiny` uses the local stack's tiny pipeline instead: seconds on a CPU (the
smoke test), where memory is not measured and only what torchao runs there is timed (the rest is reported refused).

FLUX.1 Fill [dev] and Kontext [dev] (`flux-fill`, `flux-kontext`, issue 51) at their real size reuse FLUX.1's text
encoders, tokenizers and VAE (linked from the [schnell] build: the same architectures) and build only their
transformer ([dev]'s, guidance embedded; Fill's takes the packed latents, masked image and mask: 384 channels in);
their images are measured with an input image (and Fill's mask) of the asked size.
"""

from __future__ import annotations

import gc
import statistics
import time
from pathlib import Path

# The components the comparison quantizes per family: the large ones (FLUX.1's transformer and T5-XXL; the 2026
# families' transformer and Qwen text encoder, as the catalog's z-image-turbo entry does).
COMPONENTS = {"flux": ["transformer", "text_encoder_2"], "sd15": ["unet", "text_encoder"],
              "zimage": ["transformer", "text_encoder"], "flux2-klein": ["transformer", "text_encoder"],
              "qwenimage": ["transformer", "text_encoder"], "flux-fill": ["transformer", "text_encoder_2"],
              "flux-kontext": ["transformer", "text_encoder_2"], "sd35": ["transformer", "text_encoder_3"]}  # fmt: skip
CATALOG_ENTRY = {"flux": "flux-schnell", "sd15": "sd15-txt2img", "zimage": "z-image-turbo",
                 "flux2-klein": "flux2-klein", "qwenimage": "qwen-image", "flux-fill": "flux-fill",
                 "flux-kontext": "flux-kontext", "sd35": "sd35-txt2img"}  # fmt: skip
PIPELINE_CLASS = {"flux": "FluxPipeline", "sd15": "StableDiffusionPipeline", "zimage": "ZImagePipeline",
                  "flux2-klein": "Flux2KleinPipeline", "qwenimage": "QwenImagePipeline",
                  "flux-fill": "FluxFillPipeline", "flux-kontext": "FluxKontextPipeline",
                  "sd35": "StableDiffusion3Pipeline"}  # fmt: skip
# FLUX.1's [dev]-based tools: their transformer's settings over diffusers' FLUX.1 defaults (Fill's input is the
# packed latents, the packed masked image's latents and the packed mask: 64 + 64 + 256 channels).
FLUX_TOOLS = {"flux-fill": {"guidance_embeds": True, "in_channels": 384, "out_channels": 64},
              "flux-kontext": {"guidance_embeds": True}}  # fmt: skip
# [dev]'s schedule: shifted by the image's token count (`calculate_shift`), unlike [schnell]'s.
DEV_SCHEDULER = {"shift": 3.0, "use_dynamic_shifting": True, "base_shift": 0.5, "max_shift": 1.15,
                 "base_image_seq_len": 256, "max_image_seq_len": 4096}  # fmt: skip
# The 2026 families built at their real sizes from the recorded configurations (the memory plan's own,
# tests/data/model_configs/: what contract/architectures.py counts), random weights.
RECORDED = {"zimage": "z-image-turbo", "flux2-klein": "flux.2-klein-4b", "qwenimage": "qwen-image",
            "sd35": "sd3.5-large"}  # fmt: skip
# The components built at their real size (the others are the tiny pipeline's); SD 3.5 Large's two CLIPs, and no T5
# (`LEFT_OUT`: the catalog's `without: [text_encoder_3]`, zeros of its width in its place: the same token count, so
# the same denoising step, 9.5 GB less to write).
RECORDED_COMPONENTS = {"sd35": ("transformer", "text_encoder", "text_encoder_2", "vae")}
LEFT_OUT = {"sd35": ("text_encoder_3", "tokenizer_3")}
CONFIGS = Path(__file__).resolve().parent.parent / "tests" / "data" / "model_configs"
# FLUX.1's real vocabularies (CLIP-L, T5-XXL): the embedding tables keep their real size.
CLIP_VOCAB, T5_VOCAB = 49408, 32128


def build_flux_sized(out_dir: Path) -> Path:
    """FLUX.1 [schnell] at its real size, random weights, saved as bf16 safetensors; built once per directory.
    Made in bf16 on the GPU when there is one (about 34 GB of weights), so the host never holds an fp32 copy."""
    if (out_dir / "model_index.json").exists():
        return out_dir
    import torch
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer, T5Config, T5EncoderModel

    from emulators.tiny_pipeline import build_t5_tokenizer, build_tokenizer

    bos_id, eos_id = build_tokenizer(out_dir / "tokenizer")
    t5_tokenizer = build_t5_tokenizer(out_dir / "tokenizer_2")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            transformer = FluxTransformer2DModel(guidance_embeds=False)  # diffusers' defaults: FLUX.1's sizes
            t5 = T5EncoderModel(
                T5Config(
                    vocab_size=T5_VOCAB, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
                    feed_forward_proj="gated-gelu", pad_token_id=t5_tokenizer.pad_token_id,
                    eos_token_id=t5_tokenizer.eos_token_id, decoder_start_token_id=t5_tokenizer.pad_token_id,
                )
            )  # fmt: skip
            clip = CLIPTextModel(
                CLIPTextConfig(
                    vocab_size=CLIP_VOCAB, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                    num_attention_heads=12, max_position_embeddings=77, hidden_act="quick_gelu", projection_dim=768,
                    bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=eos_id,
                )
            )  # fmt: skip
            vae = AutoencoderKL(
                in_channels=3, out_channels=3, block_out_channels=(128, 256, 512, 512), layers_per_block=2,
                down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                latent_channels=16, sample_size=1024, shift_factor=0.1159, scaling_factor=0.3611,
                use_quant_conv=False, use_post_quant_conv=False,
            )  # fmt: skip
    finally:
        torch.set_default_dtype(default_dtype)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=1.0, use_dynamic_shifting=False)  # [schnell]'s
    pipeline = FluxPipeline(
        transformer=transformer, vae=vae, text_encoder=clip, tokenizer=CLIPTokenizer.from_pretrained(out_dir / "tokenizer"),
        text_encoder_2=t5, tokenizer_2=t5_tokenizer, scheduler=scheduler,
    )  # fmt: skip
    pipeline.save_pretrained(out_dir, safe_serialization=True)
    del pipeline, transformer, t5, clip, vae
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return out_dir


def build_flux_tool_sized(family: str, out_dir: Path, flux_dir: Path) -> Path:
    """FLUX.1 Fill [dev] or Kontext [dev] at its real size: its own transformer (random, made in bf16 on the GPU
    when there is one) and [dev]'s scheduler, beside links to FLUX.1's text encoders, tokenizers and VAE in
    `flux_dir` (built first if missing): about 23.8 GB written, not 34. Built once per directory."""
    if (out_dir / "model_index.json").exists():
        return out_dir
    import json
    import shutil

    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel

    build_flux_sized(flux_dir)
    if out_dir.exists():
        shutil.rmtree(out_dir)  # a build cut off part-way
    out_dir.mkdir(parents=True)
    for shared in ("text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2", "vae"):
        (out_dir / shared).symlink_to((flux_dir / shared).resolve(), target_is_directory=True)
    FlowMatchEulerDiscreteScheduler(**DEV_SCHEDULER).save_pretrained(out_dir / "scheduler")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            transformer = FluxTransformer2DModel(**FLUX_TOOLS[family])  # FLUX.1's sizes otherwise
    finally:
        torch.set_default_dtype(default_dtype)
    transformer.save_pretrained(out_dir / "transformer", safe_serialization=True)
    del transformer
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    index = json.loads((flux_dir / "model_index.json").read_text())
    index["_class_name"] = PIPELINE_CLASS[family]
    (out_dir / "model_index.json").write_text(json.dumps(index, indent=2))  # last: the build's mark of completion
    return out_dir


def build_recorded_sized(family: str, out_dir: Path) -> Path:
    """A 2026 family's or SD 3.5 Large's pipeline at its real size: its transformer, text encoder(s) and VAE from the
    recorded configurations with random weights (made in bf16 on the GPU when there is one, so the host never holds an
    fp32 copy), the tokenizers and scheduler the tiny pipeline's (the embedding tables keep their real size); built
    once per directory. Qwen-Image's is 57.7 GB on disk, Z-Image's 20.5 GB, FLUX.2 [klein] 4B's 16.0 GB, SD 3.5 Large's
    without its T5 (`LEFT_OUT`) 17.9 GB."""
    if (out_dir / "model_index.json").exists():
        return out_dir
    import json
    import shutil

    import diffusers
    import torch
    import transformers

    from emulators.tiny_pipeline import build_pipeline

    tiny = build_pipeline(out_dir.with_name(out_dir.name + "-tokenizers"), PIPELINE_CLASS[family],
                          "cfg" if family in ("qwenimage", "sd35") else "none")  # fmt: skip
    pipeline_class = getattr(diffusers, PIPELINE_CLASS[family])
    components = dict(pipeline_class.from_pretrained(tiny).components)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            for name in RECORDED_COMPONENTS.get(family, ("transformer", "text_encoder", "vae")):
                config = json.loads((CONFIGS / RECORDED[family] / name / "config.json").read_text())
                if "_class_name" in config:
                    components[name] = getattr(diffusers, config["_class_name"]).from_config(config)
                else:
                    model_config = transformers.AutoConfig.for_model(**config)
                    components[name] = getattr(transformers, config["architectures"][0])(model_config)
    finally:
        torch.set_default_dtype(default_dtype)
    components.update(dict.fromkeys(LEFT_OUT.get(family, ())))
    pipeline = pipeline_class(**components)
    pipeline.save_pretrained(out_dir, safe_serialization=True)
    shutil.rmtree(tiny)
    del pipeline, components
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return out_dir


def weights_for(family: str, tiny: bool, workdir: Path) -> Path:
    if tiny:
        from emulators.tiny_pipeline import build_pipeline

        directory = workdir / f"{family}-tiny"
        if not (directory / "model_index.json").exists():
            guidance = (
                "embedded" if family in FLUX_TOOLS else "none" if family in ("flux", "zimage", "flux2-klein") else "cfg"
            )
            build_pipeline(directory, PIPELINE_CLASS[family], guidance)
        return directory
    if family == "flux":
        return build_flux_sized(workdir / "flux-sized")
    if family in FLUX_TOOLS:
        return build_flux_tool_sized(family, workdir / f"{family}-sized", workdir / "flux-sized")
    if family in RECORDED:
        return build_recorded_sized(family, workdir / f"{family}-sized")
    from bench.gpu_models import build_sd15_sized

    return build_sd15_sized(workdir / "sd15-sized")


def variant_spec(family: str, kind: str | None, size: int):
    """The production catalog's entry for the family, one image per call at `size`, quantized as `kind` (None: the
    serving dtype)."""
    from contract.catalog import load_catalog
    from contract.quantization import Quantization

    spec = load_catalog().get(CATALOG_ENTRY[family])
    quantization = None if kind is None else Quantization(type=kind, components=COMPONENTS[family])
    defaults = spec.defaults.model_copy(update={"width": size, "height": size})
    return spec.model_copy(update={"quantization": quantization, "max_batch_size": 1, "max_instances_per_request": 1,
                                   "scheduling": "request", "adapters": None, "defaults": defaults})  # fmt: skip


def measure(family: str, kind: str | None, compiled: bool, weights: Path, size: int, steps: int | None, calls: int,
            warmup_steps: int | None = None):  # fmt: skip
    """One variant: loaded, warmed up (compiled: at its one bucket; `warmup_steps`: the eager warm-up call's steps,
    fewer than the timed calls' for a model whose image takes a minute), `calls` images timed. A dict with
    `s_per_image` (the median), `loaded_gb` and `peak_gb` (CUDA only), or `refused` / `out_of_memory` with the
    reason."""
    import torch

    from contract.messages import GenerationParameters
    from model_worker.model.pipeline import DiffusionRunner
    from model_worker.model.quantization import QuantizationUnsupportedError
    from model_worker.model.runners import GenerationItem

    cuda = torch.cuda.is_available()
    spec = variant_spec(family, kind, size)
    steps = steps or spec.defaults.num_inference_steps
    params = GenerationParameters(seed=0, num_inference_steps=steps, guidance_scale=spec.defaults.guidance_scale,
                                  width=size, height=size, strength=spec.defaults.strength)  # fmt: skip
    inputs = edit_inputs(spec.task, size)
    row: dict = {"quantization": kind or "none", "compiled": compiled, "size": size, "steps": steps}
    runner = None
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    try:
        started = time.perf_counter()
        # On CUDA inductor (max-autotune), as the worker compiles; on a CPU torch.compile's eager backend.
        runner = DiffusionRunner(spec, weights, compile_unet=compiled, compile_backend=None if cuda else "eager")
        if cuda:
            torch.cuda.synchronize()
            row["loaded_gb"] = torch.cuda.memory_allocated() / 1e9
        if compiled:
            runner.warm_up()
        row["load_s"] = time.perf_counter() - started
        times = []
        for index in range(1 + calls):  # the first call is a warm-up
            if cuda:
                torch.cuda.synchronize()
            began = time.perf_counter()
            call = (
                params if index or not warmup_steps else params.model_copy(update={"num_inference_steps": warmup_steps})
            )
            runner.generate([GenerationItem(prompt=f"bench {index}", seed=index, **inputs)], call,
                            lambda step, total: None)  # fmt: skip
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - began)
        row["s_per_image"] = statistics.median(times[1:])
        if cuda:
            row["peak_gb"] = torch.cuda.max_memory_allocated() / 1e9
    except QuantizationUnsupportedError as exc:
        row["refused"] = str(exc)
    except torch.OutOfMemoryError as exc:
        row["out_of_memory"] = str(exc).splitlines()[0][:300]
    finally:
        del runner
        gc.collect()
        if compiled:
            torch._dynamo.reset()
        if cuda:
            torch.cuda.empty_cache()
    return row


def edit_inputs(task: str, size: int) -> dict:
    """An inpaint or edit model's inputs at `size`: an image (smooth colours) and, to inpaint, a mask repainting its
    centre quarter; none for the other tasks."""
    if task not in ("inpaint", "edit"):
        return {}
    from PIL import Image

    image = Image.linear_gradient("L").resize((size, size)).convert("RGB")
    if task == "edit":
        return {"image": image}
    mask = Image.new("L", (size, size), 0)
    mask.paste(255, (size // 4, size // 4, 3 * size // 4, 3 * size // 4))
    return {"image": image, "mask": mask}


def compare(family: str, kinds: list[str], eager: bool, compiled: bool, tiny: bool, workdir: Path, size: int,
            steps: int | None, calls: int) -> list[dict]:  # fmt: skip
    """The serving dtype, then each quantization type; eager and/or compiled. Printed as it goes."""
    started = time.perf_counter()
    weights = weights_for(family, tiny, workdir)
    print(f"{family}{' (tiny)' if tiny else ''} weights ready in {weights} ({time.perf_counter() - started:.0f}s)",
          flush=True)  # fmt: skip
    rows = []
    for kind in [None, *kinds]:
        for is_compiled in [flag for flag, wanted in ((False, eager), (True, compiled)) if wanted]:
            row = measure(family, kind, is_compiled, weights, size, steps, calls)
            rows.append(row)
            print(describe(row), flush=True)
    return rows


def describe(row: dict) -> str:
    label = f"{row['quantization']}{', compiled' if row['compiled'] else ''} at {row['size']}², {row['steps']} steps"
    if "refused" in row:
        return f"{label}: refused ({row['refused']})"
    if "out_of_memory" in row:
        return f"{label}: out of memory ({row['out_of_memory']})"
    memory = f", {row['loaded_gb']:.1f} GB loaded, {row['peak_gb']:.1f} GB peak" if "peak_gb" in row else ""
    return f"{label}: {row['s_per_image']:.2f} s/image{memory}"


def summary(rows: list[dict]) -> str:
    lines = ["| quantization | compiled | s/image | loaded GB | peak GB |", "|---|---|---|---|---|"]
    for row in rows:
        if "s_per_image" in row:
            memory = [f"{row[key]:.1f}" if key in row else "n/a (CPU)" for key in ("loaded_gb", "peak_gb")]
            cells = [f"{row['s_per_image']:.2f}", *memory]
        else:
            cells = ["refused" if "refused" in row else "out of memory", "", ""]
        lines.append(f"| {row['quantization']} | {'yes' if row['compiled'] else 'no'} | {' | '.join(cells)} |")
    return "\n".join(lines)
