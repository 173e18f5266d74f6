"""What the GPU benchmarks build: the SD-1.5-sized pipeline from configuration with random weights (no
download), and a local stand-in for the model bucket.

Shared by the SD 1.5 benchmark (bench/gpu_pipeline.py) and the quantization comparison
(bench/quantized_pipeline.py), so neither imports the other."""

from __future__ import annotations

from pathlib import Path

WEIGHT_SCALE = 0.5


def build_sd15_sized(out_dir: Path) -> Path:
    """The pipeline, from configuration, saved in fp16; built once per directory."""
    if (out_dir / "model_index.json").exists():
        return out_dir
    import torch
    from diffusers import AutoencoderKL, PNDMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    from emulators.tiny_pipeline import build_tokenizer

    torch.manual_seed(0)
    unet = UNet2DConditionModel(
        sample_size=64,
        in_channels=4,
        out_channels=4,
        block_out_channels=(320, 640, 1280, 1280),
        layers_per_block=2,
        down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
        up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3,
        cross_attention_dim=768,
        attention_head_dim=8,
    )
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        block_out_channels=(128, 256, 512, 512),
        layers_per_block=2,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        latent_channels=4,
        sample_size=512,
    )
    tokenizer_dir = out_dir / "tokenizer"
    bos_id, eos_id = build_tokenizer(tokenizer_dir)  # model_max_length 77, as SD 1.5's
    tokenizer = CLIPTokenizer.from_pretrained(tokenizer_dir)
    text_encoder = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=len(tokenizer),
            hidden_size=768,
            intermediate_size=3072,
            num_hidden_layers=12,
            num_attention_heads=12,
            max_position_embeddings=77,
            hidden_act="quick_gelu",
            projection_dim=768,
            bos_token_id=bos_id,
            eos_token_id=eos_id,
            pad_token_id=eos_id,
        )
    )
    with torch.no_grad():
        for module in (unet, vae, text_encoder):
            for parameter in module.parameters():
                parameter.mul_(WEIGHT_SCALE)
    scheduler = PNDMScheduler(
        beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", skip_prk_steps=True, steps_offset=1
    )
    pipeline = StableDiffusionPipeline(
        unet=unet, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, scheduler=scheduler,
        safety_checker=None, feature_extractor=None, requires_safety_checker=False,
    )  # fmt: skip
    pipeline.to(torch.float16).save_pretrained(out_dir, safe_serialization=True)
    return out_dir


class LocalBucket:
    """Stands in for the model bucket where the worker keeps its compile artifacts: files in a directory."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)

    def blob(self, name: str) -> LocalBlob:
        return LocalBlob(self.directory / name.replace("/", "__"))

    def get_blob(self, name: str) -> LocalBlob | None:
        blob = self.blob(name)
        return blob if blob.path.exists() else None


class LocalBlob:
    def __init__(self, path: Path) -> None:
        self.path = path

    @property
    def size(self) -> int:
        return self.path.stat().st_size

    def download_as_bytes(self) -> bytes:
        return self.path.read_bytes()

    def upload_from_string(self, data: bytes, content_type: str | None = None) -> None:
        self.path.write_bytes(data)
