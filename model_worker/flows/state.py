"""A flow's intermediate between two stages, and what is kept of each finished stage until the flow ends.

The intermediate is the previous stage's latents (a tensor, on the device while the flow stays in one worker)
or its images, resized for the next stage when the flow says so (the hires fix: in latent or pixel space, to
the next stage's planned size). Written as a safetensors file (`latents`, or `images` as uint8) when it has to
leave the process: to resume after a crash (`flows/<request_id>/stage-<i>` in the payload bucket, with the
stage's report in Redis) and to go on to another worker group's queue.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

import redis

from contract import naming
from contract.messages import FlowStagePlan, StageReport
from contract.payloads import PayloadError
from model_worker.model.runners import as_pil

log = logging.getLogger(__name__)
# The VAE's downscale in every served family with latent handoff (SD 1.5, SDXL).
LATENT_FACTOR = 8
# How long past its deadline a flow's stage records are kept (a late redelivery still finds them).
KEEP_PAST_DEADLINE_MS = 60_000


@dataclass
class Intermediate:
    """One stage's output for the next: latents (N, C, h, w) or N images (PIL)."""

    latents: Any = None
    images: list | None = None

    def inputs(self) -> list:
        """One input per instance: its latents (1, C, h, w) or its image."""
        if self.latents is not None:
            return [self.latents[i : i + 1] for i in range(self.latents.shape[0])]
        return list(self.images or [])

    def to_bytes(self) -> bytes:
        """A safetensors file; images through numpy alone, so a worker that never loads torch (the synthetic
        runners) does not import it for them."""
        import numpy as np
        from safetensors.numpy import save

        if self.latents is not None:
            from safetensors.torch import save as save_tensors

            return save_tensors({"latents": self.latents.detach().to("cpu").contiguous()})
        pixels = np.stack([np.asarray(image.convert("RGB"), dtype=np.uint8) for image in self.images or []])
        return save({"images": pixels})

    @classmethod
    def from_bytes(cls, data: bytes) -> Intermediate:
        from PIL import Image

        header_length = int.from_bytes(data[:8], "little") if len(data) >= 8 else 0
        names = set(json.loads(data[8 : 8 + header_length] or b"{}")) - {"__metadata__"}
        if names == {"latents"}:  # torch's loader: latents may be bfloat16, which numpy has not
            from safetensors.torch import load as load_tensors

            return cls(latents=load_tensors(data)["latents"])
        if names == {"images"}:
            from safetensors.numpy import load

            return cls(images=[Image.fromarray(pixels) for pixels in load(data)["images"]])
        raise ValueError(f"a flow intermediate holds `latents` or `images`, not {sorted(names)}")


def resize_latents(latents, width: int, height: int):
    """A latent-space resize (the hires fix's "latent upscale"): bilinear, to the next stage's size / 8."""
    import torch

    size = (height // LATENT_FACTOR, width // LATENT_FACTOR)
    if tuple(latents.shape[-2:]) == size:
        return latents
    with torch.inference_mode():
        return torch.nn.functional.interpolate(latents, size=size, mode="bilinear", align_corners=False)


def resize_image(image, width: int, height: int):
    """A pixel-space resize: Lanczos (as the hires fix upscales a decoded image), to the next stage's size."""
    from PIL import Image

    image = as_pil(image)
    if image.size == (width, height):
        return image
    return image.resize((width, height), Image.Resampling.LANCZOS)


def stage_output(outputs: list, plan: FlowStagePlan, following: FlowStagePlan) -> Intermediate:
    """A finished stage's outputs (latents, or float arrays from the runner) as the next stage's input, resized to
    the size planned for it."""
    width, height = following.parameters.width, following.parameters.height
    if plan.output == "latent":
        import torch

        latents = torch.cat([output if output.ndim == 4 else output.unsqueeze(0) for output in outputs])
        return Intermediate(latents=resize_latents(latents, width, height))
    return Intermediate(images=[resize_image(output, width, height) for output in outputs])


class FlowCheckpoints:
    """Each finished stage of a flow: its output in the payload bucket, its report in Redis (written after the
    output, so a report always has its output), both dropped when the flow ends."""

    def __init__(self, client: redis.Redis, bucket) -> None:
        self._redis = client
        self._bucket = bucket

    def save(self, request_id: str, report: StageReport, data: bytes, deadline_ms: int | None) -> str:
        """Keeps a stage's output and report; returns the output's URI (the claim check a forward carries)."""
        name = naming.flow_stage_object(request_id, report.index)
        self._bucket.blob(name).upload_from_string(data, content_type="application/octet-stream")
        key = naming.flow_stages_key(request_id)
        pipe = self._redis.pipeline(transaction=True)
        pipe.hset(key, str(report.index), report.model_dump_json())
        if deadline_ms is not None:
            pipe.pexpireat(key, deadline_ms + KEEP_PAST_DEADLINE_MS)
        pipe.execute()
        return f"gs://{self._bucket.name}/{name}"

    def reports(self, request_id: str) -> list[StageReport]:
        """The reports of the stages finished so far, in stage order."""
        raw = self._redis.hgetall(naming.flow_stages_key(request_id))
        reports = [StageReport.model_validate_json(value) for value in raw.values()]
        return sorted(reports, key=lambda report: report.index)

    def load(self, request_id: str, index: int) -> bytes:
        return self._bucket.blob(naming.flow_stage_object(request_id, index)).download_as_bytes()

    def uri(self, request_id: str, index: int) -> str:
        return f"gs://{self._bucket.name}/{naming.flow_stage_object(request_id, index)}"

    def read_uri(self, uri: str) -> bytes:
        """A forwarded stage's output by its claim check (only this bucket's flow objects)."""
        prefix = f"gs://{self._bucket.name}/flows/"
        if not uri.startswith(prefix):
            raise PayloadError(f"a flow's intermediate must be under {prefix}")
        try:
            return self._bucket.blob(uri.removeprefix(f"gs://{self._bucket.name}/")).download_as_bytes()
        except Exception as exc:  # noqa: BLE001 - NotFound and transport errors alike
            raise PayloadError(f"cannot read {uri}: {exc}") from exc

    def forget(self, request_id: str) -> None:
        """The flow ended: its outputs and reports go."""
        self._redis.delete(naming.flow_stages_key(request_id))
        for blob in self._bucket.list_blobs(prefix=naming.flow_stage_prefix(request_id)):
            blob.delete()
