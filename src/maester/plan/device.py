"""What of a GPU's memory a run can count on, and the plan's verdict of a peak against it.

    room   = total_memory - the CUDA context and library workspaces - the communication library's buffers
    usable = room x ALLOCATOR_SHARE (the caching allocator's rounding and fragmentation)

`total_memory` is what torch reports for the GPU kind (`torch.cuda.get_device_properties(i).total_memory`), a
little below the datasheet's figure (an 80 GB H100 shows 79.2 GiB); where no measurement is at hand it is estimated
from the datasheet by the share the measured kinds of the same vendor show. A peak with less than TIGHT_GIB of
headroom below `usable` is "tight"; one above `room` runs out of memory.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

# torch's total_memory in MiB, as users report `torch.cuda.get_device_properties` in public bug reports and logs
# (H100 SXM: 81,082 to 81,090 MiB on several machines). One GCD for MI250X.
MEASURED_MIB = {"H100": 81_089, "H100 PCIe": 81_008, "H200": 143_156, "B200": 182_631, "MI250X": 65_520,
                "MI300X": 196_592}
# total_memory over the datasheet's GiB, for the kinds without a measurement (the measured NVIDIA kinds show
# 0.989-0.991, the AMD ones 0.9998).
VENDOR_SHARE = {"nvidia": 0.99, "amd": 0.9998}
CONTEXT_GIB = 0.75
"""The CUDA/HIP context with its kernels loaded lazily, cuBLAS and cuDNN workspaces (about 0.5-1 GiB a process)."""
COMMUNICATION_GIB = 1.0
"""NCCL/RCCL's buffers where a run has several GPUs: nccl-tests keeps 1 GiB free for CUDA and NCCL on HGX/DGX
nodes (NVIDIA/nccl-tests#198), which NVLink SHARP (NVLS) can exceed (#220; NCCL_NVLS_ENABLE=0 frees that)."""
ALLOCATOR_SHARE = 0.95
"""Of the room, what the caching allocator turns into tensors: it reserves more than it allocates (block rounding,
fragmentation). The GPU check reports both, max_memory_reserved_gib and max_memory_allocated_gib."""
TIGHT_GIB = 2.0


def total_memory_gib(key: str, datasheet_gib: float) -> tuple[float, str]:
    """(torch's total_memory of GPU kind `key` in GiB, where the figure comes from)."""
    if key in MEASURED_MIB:
        return MEASURED_MIB[key] / 1024, "measured"
    vendor = "amd" if key.startswith("MI") else "nvidia"
    share = VENDOR_SHARE[vendor]
    return datasheet_gib * share, f"estimated: {share:g} of the datasheet's {datasheet_gib:g} GiB"


@dataclass(frozen=True)
class DeviceMemory:
    gpu: str
    total_gib: float
    """torch's total_memory of one device."""
    total_from: str
    context_gib: float
    communication_gib: float
    allocator_share: float = ALLOCATOR_SHARE

    @property
    def room_gib(self) -> float:
        return max(self.total_gib - self.context_gib - self.communication_gib, 0.0)

    @property
    def usable_gib(self) -> float:
        return self.room_gib * self.allocator_share

    def describe(self) -> str:
        parts = [f"{self.total_gib:.1f} GiB that torch sees on one {self.gpu} ({self.total_from})",
                 f"{self.context_gib:.2f} CUDA context and workspaces"]
        if self.communication_gib:
            parts.append(f"{self.communication_gib:.2f} NCCL buffers")
        return (f"{self.usable_gib:.1f} GiB a run can count on: ({' - '.join(parts)}) x {self.allocator_share:g} "
                f"(the allocator's rounding and fragmentation)")

    def to_json(self) -> dict:
        return {**asdict(self), "room_gib": self.room_gib, "usable_gib": self.usable_gib}


def device_memory(key: str, datasheet_gib: float, gpus: int, gpu_memory: float | None = None) -> DeviceMemory:
    """The memory of one of `gpus` GPUs of kind `key`; `gpu_memory`: torch's total_memory in GiB, given instead."""
    if gpu_memory is not None:
        if not math.isfinite(gpu_memory) or gpu_memory <= 0:
            raise ValueError(f"--gpu-memory {gpu_memory} must be a positive, finite number of GiB")
        total, source = gpu_memory, "--gpu-memory"
    else:
        total, source = total_memory_gib(key, datasheet_gib)
    return DeviceMemory(key, total, source, CONTEXT_GIB, COMMUNICATION_GIB if gpus > 1 else 0.0)


@dataclass(frozen=True)
class Verdict:
    kind: str  # "fits", "tight" or "out_of_memory"
    line: str


def gib_text(value: float) -> str:
    """GiB as the plan prints them: two decimals below 10."""
    return f"{value:.1f}" if value >= 10 else f"{value:.2f}"


def verdict(peak_gib: float, device: DeviceMemory) -> Verdict:
    usable, peak = device.usable_gib, gib_text(peak_gib)
    headroom = usable - peak_gib
    if headroom >= TIGHT_GIB:
        return Verdict("fits", f"fits, with {gib_text(headroom)} GiB of headroom: peak {peak} GiB of the "
                               f"{gib_text(usable)} GiB a run can count on")
    if peak_gib <= device.room_gib:
        where = (f"{gib_text(headroom)} GiB of headroom" if headroom >= 0 else
                 f"{gib_text(-headroom)} GiB above the {gib_text(usable)} GiB a run can count on")
        return Verdict("tight", f"tight: peak {peak} GiB, {where} (under {TIGHT_GIB:g} GiB is tight); the "
                                f"allocator's fragmentation may make it run out")
    return Verdict("out_of_memory", f"runs out of memory by {gib_text(peak_gib - device.room_gib)} GiB: peak "
                                    f"{peak} GiB, and {gib_text(device.room_gib)} GiB is all the allocator can have "
                                    f"of the {device.total_gib:.1f} GiB")
