"""The served model architectures' recorded sizes: each pipeline component's parameter count and the shape of its
activations, the numbers the memory plan (contract/memory_plan.py) reads where torch is not installed (the API).

Counted from each architecture's real configuration instantiated on the `meta` device (no weights), and checked by
tests/unit/test_memory_plan.py, which recounts them from tests/data/model_configs/ (sources in its README.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ComponentSize:
    # Parameters and persistent floating-point buffers (SD 3's positional embedding): what the weights files hold.
    parameters: int
    # The part in nn.Linear weights: what torchao's weight quantization changes (convolutions, norms, embeddings
    # and biases keep the serving dtype).
    linear_weights: int
    # Output rows of those Linear layers: one quantization scale each (torchao's per-row / per-channel scales).
    linear_rows: int


@dataclass(frozen=True)
class Architecture:
    name: str
    family: str
    components: dict[str, ComponentSize]
    # The denoiser's activation elements per row of its batch per token (a latent pixel for a UNet, an image or
    # text token for a transformer), counted from the configuration (see `denoiser_elements_per_token`).
    denoiser_elements_per_token: int
    # Output pixels per denoiser token: 8x8 for a UNet's latent pixel, 16x16 for a transformer's 2x2 patch.
    pixels_per_token: int
    # Text tokens the transformer attends over beside the image (0: a UNet's cross-attention keeps them apart).
    text_tokens: int = 0
    denoiser: str = field(default="transformer")
    # A UNet's down-path residuals per latent pixel (its skip tensors), the shapes a ControlNet hands it: what the
    # memory plan counts for a model that takes ControlNets (`unet_skip_elements_per_token`); 0 for transformers.
    skip_elements_per_token: int = 0
    # A transformer's blocks that each take a ControlNet residual (its image tokens x the hidden width, in the
    # transformer's dtype): FLUX.1's double and single blocks, SD 3.5's joint blocks; 0 for a UNet and for the
    # families that take no ControlNets. What the memory plan counts for a model that takes them.
    control_blocks: int = 0

    @property
    def controlnet_blocks(self) -> int:
        """The deepest ControlNet the memory plan counts for a transformer, in residuals it hands on (a FLUX.1
        ControlNet's double and single blocks, an SD 3.5 one's blocks): half its transformer's blocks, 28 for FLUX.1
        (InstantX's have 5 + 10, Shakker-Labs' Union Pro 6, XLabs' 2), 19 for SD 3.5 Large (Stability's have 19).
        Registration refuses a deeper one (contract/memory_plan.py `controlnet_depth_problem`)."""
        return self.control_blocks // 2


# An element count per token: a transformer block's widest moment holds its input and residual streams, the
# normalised copy, q/k/v, the attention output and the 4x-wide MLP's two tensors (attention itself runs through
# SDPA's memory-efficient kernels, nothing quadratic kept): about 20 x the hidden width.
TRANSFORMER_WIDTHS_PER_TOKEN = 20
# A UNet's working block at full latent resolution (GEGLU's 8x-wide projection, q/k/v, the up path's concatenated
# input) holds about 24 x its first block's channels; the skip connections kept for the up path are added.
UNET_WIDTHS_PER_TOKEN = 24


def transformer_elements_per_token(hidden: int) -> int:
    return TRANSFORMER_WIDTHS_PER_TOKEN * hidden


def unet_elements_per_token(block_out_channels: list[int], layers_per_block: int) -> int:
    """The UNet's working block plus every skip tensor the down path keeps, per full-resolution latent pixel."""
    return int(UNET_WIDTHS_PER_TOKEN * block_out_channels[0] + unet_skips(block_out_channels, layers_per_block))


def unet_skips(block_out_channels: list[int], layers_per_block: int) -> float:
    """The skip tensors the UNet's down path keeps (conv_in's, each resnet's and each downsampler's), each at its
    resolution (a quarter of the pixels per level), per full-resolution latent pixel; a ControlNet's down residuals
    are one per skip, of its shape (and the mid block's, a sixty-fourth of the last level's, is left out)."""
    skips = block_out_channels[0]
    for level, channels in enumerate(block_out_channels):
        skips += layers_per_block * channels / 4**level
        if level < len(block_out_channels) - 1:
            skips += channels / 4 ** (level + 1)
    return skips


CLIP_L = ComponentSize(123_060_480, 84_934_656, 82_944)
CLIP_L_PROJECTION = ComponentSize(123_650_304, 85_524_480, 83_712)
CLIP_G_PROJECTION = ComponentSize(694_659_840, 630_784_000, 369_920)
T5_XXL = ComponentSize(4_762_310_656, 4_630_511_616, 983_040)
VAE_4 = ComponentSize(83_653_863, 2_097_152, 4_096)
VAE_16 = ComponentSize(83_819_683, 2_097_152, 4_096)
# Qwen3-4B as Z-Image reads it (`Qwen3Model`: no language-model head).
QWEN3_4B = ComponentSize(4_022_468_096, 3_633_315_840, 1_105_920)
# ... and as FLUX.2 [klein] 4B reads it (`Qwen3ForCausalLM`: its head is tied to the embedding, a Linear of its own).
QWEN3_4B_LM = ComponentSize(4_022_468_096, 4_022_272_000, 1_257_856)
# Qwen3-8B as FLUX.2 [klein] 9B reads it (`Qwen3ForCausalLM`, its head a Linear of its own: untied in the 8B).
QWEN3_8B_LM = ComponentSize(8_190_735_360, 7_568_097_280, 1_552_768)
# FLUX.2's VAE: 32 latent channels and a batch norm over its 2x2-patchified latents.
VAE_FLUX2 = ComponentSize(84_046_371, 2_097_152, 4_096)

ARCHITECTURES: dict[str, Architecture] = {
    arch.name: arch
    for arch in (
        Architecture(
            "sd1.5", "sd15",
            {"unet": ComponentSize(859_520_964, 270_049_280, 234_880), "text_encoder": CLIP_L, "vae": VAE_4},
            denoiser_elements_per_token=unet_elements_per_token([320, 640, 1280, 1280], 2),
            pixels_per_token=64, denoiser="unet", skip_elements_per_token=round(unet_skips([320, 640, 1280, 1280], 2)),
        ),
        Architecture(
            "sdxl", "sdxl",
            {"unet": ComponentSize(2_567_463_684, 2_232_647_680, 1_455_040), "text_encoder": CLIP_L,
             "text_encoder_2": CLIP_G_PROJECTION, "vae": VAE_4},
            denoiser_elements_per_token=unet_elements_per_token([320, 640, 1280], 2),
            pixels_per_token=64, denoiser="unet", skip_elements_per_token=round(unet_skips([320, 640, 1280], 2)),
        ),
        Architecture(
            "flux.1-dev", "flux",
            {"transformer": ComponentSize(11_901_408_320, 11_898_322_944, 3_065_920), "text_encoder": CLIP_L,
             "text_encoder_2": T5_XXL, "vae": VAE_16},
            denoiser_elements_per_token=transformer_elements_per_token(24 * 128),
            pixels_per_token=256, text_tokens=512, control_blocks=19 + 38,
        ),
        Architecture(
            "flux.1-schnell", "flux",
            {"transformer": ComponentSize(11_891_178_560, 11_888_099_328, 3_059_776), "text_encoder": CLIP_L,
             "text_encoder_2": T5_XXL, "vae": VAE_16},
            denoiser_elements_per_token=transformer_elements_per_token(24 * 128),
            pixels_per_token=256, text_tokens=256,  # [schnell] encodes 256 T5 tokens, [dev] 512
            control_blocks=19 + 38,
        ),
        Architecture(
            # FLUX.1 Fill [dev]: [dev]'s transformer taking the masked image's latents and the mask beside the latents
            # (384 input channels, 64 out); the tokens, and so the activations, are [dev]'s.
            "flux.1-fill-dev", "flux",
            {"transformer": ComponentSize(11_902_391_360, 11_899_305_984, 3_065_920), "text_encoder": CLIP_L,
             "text_encoder_2": T5_XXL, "vae": VAE_16},
            denoiser_elements_per_token=transformer_elements_per_token(24 * 128),
            pixels_per_token=256, text_tokens=512,
        ),
        Architecture(
            "sd3.5-medium", "sd3",
            {"transformer": ComponentSize(2_469_663_936, 2_241_822_720, 1_241_152),
             "text_encoder": CLIP_L_PROJECTION, "text_encoder_2": CLIP_G_PROJECTION, "text_encoder_3": T5_XXL,
             "vae": VAE_16},
            denoiser_elements_per_token=transformer_elements_per_token(24 * 64),
            pixels_per_token=256, text_tokens=77 + 256,  # the CLIP tokens, then T5's max_sequence_length
            control_blocks=24,
        ),
        Architecture(
            "sd3.5-large", "sd3",
            {"transformer": ComponentSize(8_146_280_768, 8_053_694_464, 2_765_248),
             "text_encoder": CLIP_L_PROJECTION, "text_encoder_2": CLIP_G_PROJECTION, "text_encoder_3": T5_XXL,
             "vae": VAE_16},
            denoiser_elements_per_token=transformer_elements_per_token(38 * 64),
            pixels_per_token=256, text_tokens=77 + 256, control_blocks=38,
        ),
        Architecture(
            "z-image-turbo", "zimage",
            {"transformer": ComponentSize(6_154_908_736, 6_153_863_168, 1_853_504), "text_encoder": QWEN3_4B,
             "vae": VAE_16},
            denoiser_elements_per_token=transformer_elements_per_token(30 * 128),
            pixels_per_token=256, text_tokens=512,  # its pipeline's max_sequence_length
        ),
        Architecture(
            "flux.2-klein-4b", "flux2-klein",
            {"transformer": ComponentSize(3_875_544_576, 3_875_536_896, 1_016_960), "text_encoder": QWEN3_4B_LM,
             "vae": VAE_FLUX2},
            denoiser_elements_per_token=transformer_elements_per_token(24 * 128),
            pixels_per_token=256, text_tokens=512,  # its pipeline's max_sequence_length
        ),
        Architecture(
            "flux.2-klein-9b", "flux2-klein",
            {"transformer": ComponentSize(9_078_581_248, 9_078_571_008, 1_790_080), "text_encoder": QWEN3_8B_LM,
             "vae": VAE_FLUX2},
            denoiser_elements_per_token=transformer_elements_per_token(32 * 128),
            pixels_per_token=256, text_tokens=512,  # its pipeline's max_sequence_length
        ),
        Architecture(
            "qwen-image", "qwenimage",
            {"transformer": ComponentSize(20_430_401_088, 20_424_818_688, 5_548_096),
             # Qwen2.5-VL-7B: its vision tower (unused for text) and language-model head are loaded with it.
             "text_encoder": ComponentSize(8_292_166_656, 7_744_815_104, 1_975_040),
             "vae": ComponentSize(126_892_531, 0, 0)},  # a causal 3-D VAE: convolutions only
            denoiser_elements_per_token=transformer_elements_per_token(24 * 128),
            pixels_per_token=256, text_tokens=512,  # its pipeline's max_sequence_length
        ),
    )
}  # fmt: skip
# The architecture a catalog entry of a family serves unless it names one (`architecture:`).
DEFAULT_ARCHITECTURE = {
    "sd15": "sd1.5", "sdxl": "sdxl", "flux": "flux.1-dev", "sd3": "sd3.5-large", "zimage": "z-image-turbo",
    "flux2-klein": "flux.2-klein-4b", "qwenimage": "qwen-image",
}  # fmt: skip
