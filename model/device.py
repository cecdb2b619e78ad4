"""Host tensors onto the step's device, and its results back, without stalling the host."""

import torch


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`host` (a CPU tensor built for this step) on `device`. On CUDA it is pinned first: a non_blocking copy from
    pageable memory is staged through a pinned buffer and waits for the work queued before it, so a step's
    metadata would hold the host until the GPU caught up. On the CPU it is `host` itself."""
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def to_host(tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], torch.cuda.Event | None]:
    """Device tensors copied to the host without waiting for them: into pinned buffers, with an event recorded
    after the copies (synchronize it before reading them). On the CPU, the tensors themselves and no event."""
    if not tensors or tensors[0].device.type != "cuda":
        return tensors, None
    host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True) for t in tensors]
    ready = torch.cuda.Event()
    ready.record()
    return host, ready
