"""Host values to a device tensor without a host synchronisation (the sampler's and the runners' one helper)."""

from __future__ import annotations

import torch


def to_device(values, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A tensor of the Python ``values`` on ``device`` without a host synchronisation.

    ``torch.tensor(values, device="cuda")`` copies from pageable memory and
    waits for the GPU; here the values go through pinned memory with a
    non-blocking copy, ordered on the current stream like any kernel.
    """
    t = torch.tensor(values, dtype=dtype)
    if torch.device(device).type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)
