"""How a catalog unit's components are quantized at load (issue 36): the shape both the memory plan and the
worker read. Weights stay safetensors in the bucket; the worker quantizes on load through diffusers'
`PipelineQuantizationConfig` with a torchao `AOBaseConfig`."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

QuantizationType = Literal["float8_weight_only", "float8_dynamic", "int8_weight_only"]
# Bytes a quantized weight takes (its scales are counted by the memory plan on their own).
QUANTIZED_BYTES_PER_PARAMETER: dict[str, int] = {
    "float8_weight_only": 1,
    "float8_dynamic": 1,
    "int8_weight_only": 1,
}
# fp8 tensor cores need compute capability 8.9 (Ada: L4; Hopper: H100); an A100 (8.0) has none.
FLOAT8_MIN_COMPUTE_CAPABILITY = (8, 9)


class Quantization(BaseModel):
    """`quantization:` on a catalog entry or version."""

    model_config = ConfigDict(extra="forbid")
    backend: Literal["torchao"] = "torchao"
    type: QuantizationType
    # Pipeline components to quantize (e.g. transformer, text_encoder_2); the others keep the serving dtype.
    components: list[str] = Field(min_length=1)

    @property
    def needs_float8(self) -> bool:
        return self.type.startswith("float8")
