"""Host tensors onto the step's device without stalling the host."""

import torch


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`host` (a CPU tensor built for this step) on `device`. On CUDA it is pinned first: a non_blocking copy from
    pageable memory is staged through a pinned buffer and waits for the work queued before it, so a step's
    metadata would hold the host until the GPU caught up. On the CPU it is `host` itself."""
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)
