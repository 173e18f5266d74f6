"""The GPUs a catalog unit may name (`hardware:`): their memory, compute capability and the reserve the memory plan
keeps back, for the catalog's check (contract/memory_plan.py), the renderer and the worker's check at load."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

GIB = 1024**3
MIB = 1024**2

HardwareName = Literal["l4", "a100", "a100-80", "h100"]
# Memory a process cannot allocate tensors in: the CUDA context with cuBLAS/cuDNN workspaces (about 0.5 GiB on these
# cards) and the caching allocator's fragmentation at the peak. Stated, not measured here (no GPU was lent).
RESERVE_BYTES = 1 * GIB
# Pods that time-share one GPU (`gpu_sharing: true`; GKE's max_shared_clients_per_gpu, infra/k8s/render.py): they
# share its memory, which time-sharing does not divide, so each gets this share of the plan's room.
MAX_SHARED_CLIENTS_PER_GPU = 2


@dataclass(frozen=True)
class Gpu:
    name: str
    # What nvidia-smi reports as the card's total (MiB): the "24 GB" L4 holds 23,034 MiB.
    memory_mib: int
    compute_capability: tuple[int, int]

    @property
    def memory_bytes(self) -> int:
        return self.memory_mib * MIB

    @property
    def usable_bytes(self) -> int:
        """What the plan lets a worker's weights and activations take: the card less the reserve."""
        return self.memory_bytes - RESERVE_BYTES

    def share_bytes(self, gpu_sharing: bool, clients: int = MAX_SHARED_CLIENTS_PER_GPU) -> int:
        """One pod's room: the usable memory, or its share of it when pods time-share the card."""
        return self.usable_bytes // (clients if gpu_sharing else 1)


# NVIDIA's data sheets; the MiB are the totals nvidia-smi shows for each card.
HARDWARE: dict[str, Gpu] = {
    "l4": Gpu("NVIDIA L4 (24 GB, Ada)", 23_034, (8, 9)),
    "a100": Gpu("NVIDIA A100 40GB (Ampere)", 40_960, (8, 0)),
    "a100-80": Gpu("NVIDIA A100 80GB (Ampere)", 81_920, (8, 0)),
    "h100": Gpu("NVIDIA H100 80GB (Hopper)", 81_559, (9, 0)),
}
