"""What accelerators this process can see: the one place outside a worker that asks torch."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class CudaDevices:
    count: int  # 0 when torch finds no CUDA device
    name: str | None  # device 0's name
    build: str  # e.g. "torch 2.13.0, a CPU-only build"


def cuda_devices() -> CudaDevices:
    import torch  # imported on demand: a CPU-only config check never pays for it

    build = f"torch {torch.__version__}" + \
        (", a CPU-only build" if torch.version.cuda is None else f" built for CUDA {torch.version.cuda}")
    if not torch.cuda.is_available():
        return CudaDevices(0, None, build)
    return CudaDevices(torch.cuda.device_count(), torch.cuda.get_device_name(0), build)
