"""The worker's check of a unit's memory plan (contract/memory_plan.py) against the real GPU before it loads: the
catalog checked the plan against the hardware table; here the device's own free memory decides, and the downloaded
weights' safetensors headers say whether the plan counted the right architecture."""

from __future__ import annotations

import logging
import math
from pathlib import Path

from contract.memory_plan import gib, unit_plan
from contract.model_spec import ModelSpec
from contract.safetensors_checks import read_file_header

log = logging.getLogger(__name__)


# How far a component's parameters in its files may exceed the plan's count before the plan is taken to be wrong.
PARAMETER_TOLERANCE = 0.05


class DeviceMemoryError(MemoryError):
    """The device has less free memory than the unit's plan needs: a restart, or another node, may have more."""


def file_parameters(weights_dir: Path) -> dict[str, int]:
    """Parameters per pipeline component (its folder) in a diffusers folder's safetensors, from their headers."""
    counts: dict[str, int] = {}
    for path in sorted(weights_dir.glob("*/*.safetensors")):
        tensors = read_file_header(path)
        counts[path.parent.name] = counts.get(path.parent.name, 0) + sum(
            math.prod(entry["shape"]) for entry in tensors.values()
        )
    return counts


def plan_problem(spec: ModelSpec, weights_dir: Path) -> str | None:
    """Why the plan undercounts these weights (a component holds more parameters than its architecture's), or None."""
    plan = unit_plan(spec)
    counted = file_parameters(weights_dir)
    for component in plan.components:
        found = counted.get(component.name, 0)
        if found > component.parameters * (1 + PARAMETER_TOLERANCE):
            return (
                f"{spec.queue}: {component.name} holds {found:,} parameters in {weights_dir}, and its memory plan "
                f"counts {component.parameters:,} ({plan.architecture}): name the weights' `architecture:` in the "
                "catalog"
            )
    return None


def check_device_memory(spec: ModelSpec, torch, weights_dir: Path | None = None, shared: bool = False) -> None:
    """Raises DeviceMemoryError when the CUDA device's free memory (`torch.cuda.mem_get_info`) is below the unit's
    planned weights, control budget (`controls.device_bytes`) and activation peak, or when the weights hold more
    parameters than the plan counted; on a CPU
    there is nothing to check (the local stack's tiny pipelines), and the log says so. `shared`: the unit is built
    from components another unit loaded (the same `loaded_components`): they are on the device already, out of its
    free memory, so only the activation peak is checked (as the deployment's plan counts them once)."""
    plan = unit_plan(spec)
    if plan is None:
        return
    weights_bytes = 0 if shared else plan.weights_bytes
    controls = f" + control budget {gib(plan.control_bytes)}" if plan.control_bytes else ""
    needed = (
        f"weights {gib(weights_bytes)}{' (shared, loaded already)' if shared else ''}{controls} + activation "
        f"{gib(plan.activation_bytes)} ({plan.activation_phase} at batch {plan.batch}, {plan.width}x{plan.height})"
    )
    if not torch.cuda.is_available():
        log.info("memory plan of %s: %s; the check against the device is skipped: no CUDA device", spec.queue, needed)
        return
    if weights_dir is not None and not shared and (problem := plan_problem(spec, weights_dir)) is not None:
        raise DeviceMemoryError(problem)
    free, total = torch.cuda.mem_get_info()
    device = torch.cuda.get_device_name(0)
    if weights_bytes + plan.control_bytes + plan.activation_bytes > free:
        total_needed = gib(weights_bytes + plan.control_bytes + plan.activation_bytes)
        raise DeviceMemoryError(
            f"{spec.queue}: its memory plan needs {total_needed} ({needed}) and the GPU ({device}) has "
            f"{gib(free)} free of {gib(total)}: not loaded"
        )
    log.info("memory plan of %s: %s, within %s free of %s on %s", spec.queue, needed, gib(free), gib(total), device)
