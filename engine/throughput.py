"""Peak FLOP/s of known accelerators, for model FLOPs utilisation (MFU).

The table holds NVIDIA's published dense (no sparsity) BF16 Tensor Core peaks from the
A100, H100, H200 and B200 datasheets, per GPU. MFU is reported against the BF16 peak
whatever the training dtype, as torchtitan does, so runs are comparable. A device not
in the table (any CPU, an unlisted GPU) gets no MFU, only achieved FLOP/s.
"""

from __future__ import annotations

import torch

# Checked in order: the first name fragment found in the device name wins.
PEAK_BF16_FLOPS = (
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),  # SXM
    ("H200", 989e12),
    ("B200", 2250e12),
    ("A100", 312e12),
)


def peak_flops_for(device_name: str) -> float | None:
    for fragment, peak in PEAK_BF16_FLOPS:
        if fragment in device_name:
            return peak
    return None


def device_peak_flops(device: torch.device) -> tuple[str, float | None]:
    """(device name, peak FLOP/s per device or None when unknown)."""
    if device.type != "cuda":
        return device.type, None
    name = torch.cuda.get_device_name(device)
    return name, peak_flops_for(name)
