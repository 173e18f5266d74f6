"""The worker's check of a unit's memory plan (contract/memory_plan.py) against the real GPU before it loads: the
catalog checked the plan against the hardware table; here the device's own free memory decides."""

from __future__ import annotations

import logging

from contract.catalog import ModelSpec
from contract.memory_plan import gib, unit_plan

log = logging.getLogger(__name__)


class DeviceMemoryError(MemoryError):
    """The device has less free memory than the unit's plan needs: a restart, or another node, may have more."""


def check_device_memory(spec: ModelSpec, torch) -> None:
    """Raises DeviceMemoryError when the CUDA device's free memory (`torch.cuda.mem_get_info`) is below the unit's
    planned weights and activation peak; on a CPU there is nothing to check, and the log says so."""
    plan = unit_plan(spec)
    if plan is None:
        return
    needed = (
        f"weights {gib(plan.weights_bytes)} + activation {gib(plan.activation_bytes)} "
        f"({plan.activation_phase} at batch {plan.batch}, {plan.width}x{plan.height})"
    )
    if not torch.cuda.is_available():
        log.info("memory plan of %s: %s; the check against the device is skipped: no CUDA device", spec.queue, needed)
        return
    free, total = torch.cuda.mem_get_info()
    device = torch.cuda.get_device_name(0)
    if plan.total_bytes > free:
        raise DeviceMemoryError(
            f"{spec.queue}: its memory plan needs {gib(plan.total_bytes)} ({needed}) and the GPU ({device}) has "
            f"{gib(free)} free of {gib(total)}: not loaded"
        )
    log.info("memory plan of %s: %s, within %s free of %s on %s", spec.queue, needed, gib(free), gib(total), device)
