"""What NIXL's UCX backend checks about this host before it starts, read here to name the cause.

NIXL 1.5 refuses to create its UCX backend when ``UCX_TLS`` leaves out every CUDA transport on a
host with NVIDIA GPUs, whatever memory the agent would register, and says why only in its log
(the exception is a bare ``NIXL_ERR_BACKEND``). So ``UCX_TLS=tcp``, the usual way to force TCP,
stops every agent on a GPU server; ``tcp,cuda_copy`` still moves host memory over TCP alone.
NIXL counts GPUs from PCI sysfs (NVIDIA's vendor id, a display or 3D controller class), so
``CUDA_VISIBLE_DEVICES`` does not change its answer; neither does it here.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

__all__ = ["PCI_DEVICES", "backend_start_hint", "nvidia_gpus", "tcp_only_tls", "tls_enables_cuda"]

PCI_DEVICES = Path("/sys/bus/pci/devices")
_NVIDIA_VENDOR = 0x10DE
_GPU_CLASSES = frozenset({0x0300, 0x0302})  # VGA-compatible display controller, 3D controller
_CUDA_TLS = frozenset({"all", "cuda", "cuda_copy", "\\cuda_copy"})  # the names NIXL takes as CUDA support


def _read_hex(path: Path) -> int | None:
    try:
        return int(path.read_text().strip(), 0)
    except (OSError, ValueError):
        return None


def nvidia_gpus(pci_devices: Path = PCI_DEVICES) -> int:
    """How many NVIDIA GPUs this host's PCI bus shows (0 where sysfs cannot be read)."""
    try:
        devices = list(pci_devices.iterdir())
    except OSError:
        return 0
    count = 0
    for device in devices:
        pci_class = _read_hex(device / "class")
        if _read_hex(device / "vendor") == _NVIDIA_VENDOR and pci_class is not None and pci_class >> 8 in _GPU_CLASSES:
            count += 1
    return count


def tls_enables_cuda(tls: str) -> bool:
    """Whether NIXL reads ``UCX_TLS=tls`` as enabling CUDA memory (a leading ``^`` is a deny list)."""
    deny = tls.startswith("^")
    named = set(tls.removeprefix("^").split(","))  # (NIXL matches ",name," exactly: " cuda_copy" is not it)
    return bool(named & _CUDA_TLS) != deny


def tcp_only_tls(gpus: int) -> str:
    """The ``UCX_TLS`` that moves host memory over TCP alone and that NIXL accepts on this host.

    Where there is no GPU, ``cuda_copy`` would only draw UCX's "transport is not available" warning.
    """
    return "tcp,cuda_copy" if gpus else "tcp"


def backend_start_hint(backend: str, environ: Mapping[str, str], gpus: int) -> str:
    """Why NIXL most likely refused to start `backend`, where this host shows it ("" if not)."""
    tls = environ.get("UCX_TLS")
    if backend != "UCX" or tls is None or gpus == 0 or tls_enables_cuda(tls):
        return ""
    return (
        f"UCX_TLS={tls!r} enables no CUDA transport and this host has {gpus} NVIDIA GPU(s): NIXL refuses "
        f"to start UCX so. Add cuda_copy (UCX_TLS={tcp_only_tls(gpus)!r} still moves host memory over TCP "
        "alone), or cuda to include NVLink"
    )
