"""What this host shows NIXL's UCX backend: NVIDIA GPUs on the PCI bus, and whether UCX_TLS enables CUDA.

NIXL 1.5 refuses to start UCX with ``UCX_TLS=tcp`` on a host with NVIDIA GPUs (seen on an H200:
"Invalid UCX_TLS=tcp for NIXL UCX backend: NVIDIA GPU(s) are present"), and raises a bare
NIXL_ERR_BACKEND; these are the pure rules the engine names that cause with.
"""

from pathlib import Path

import pytest

from nixl_async._host import backend_start_hint, nvidia_gpus, tcp_only_tls, tls_enables_cuda


def _device(root: Path, name: str, vendor: str, pci_class: str) -> None:
    (root / name).mkdir(parents=True)
    (root / name / "vendor").write_text(vendor + "\n")
    (root / name / "class").write_text(pci_class + "\n")


def test_nvidia_gpus_counts_nvidia_display_and_3d_controllers_only(tmp_path):
    _device(tmp_path, "0000:00:01.0", "0x10de", "0x030200")  # H100/H200: 3D controller
    _device(tmp_path, "0000:00:02.0", "0x10de", "0x030000")  # a display controller
    _device(tmp_path, "0000:00:03.0", "0x10de", "0x068000")  # NVIDIA's NVSwitch bridge: no GPU
    _device(tmp_path, "0000:00:04.0", "0x1002", "0x030200")  # AMD
    _device(tmp_path, "0000:00:05.0", "0x15b3", "0x020700")  # a Mellanox IB card
    (tmp_path / "0000:00:06.0").mkdir()  # no files: skipped, as NIXL does
    _device(tmp_path, "0000:00:07.0", "garbage", "0x030200")
    assert nvidia_gpus(tmp_path) == 2


def test_nvidia_gpus_is_zero_where_sysfs_is_absent(tmp_path):
    assert nvidia_gpus(tmp_path / "missing") == 0


@pytest.mark.parametrize(
    ("tls", "enables"),
    [
        ("tcp", False),
        ("tcp,cuda_copy", True),
        ("cuda,tcp", True),
        ("all", True),
        ("rc,cuda_copy", True),
        ("rc, cuda_copy", False),  # NIXL finds ",cuda_copy," only: a space hides it
        ("\\cuda_copy,tcp", True),
        ("cuda_ipc,tcp", False),  # not what NIXL takes as CUDA support
        ("^cuda_copy", False),  # a deny list naming it
        ("^tcp", True),  # a deny list that leaves CUDA in
        ("", False),
    ],
)
def test_tls_enables_cuda_reads_ucx_tls_as_nixl_does(tls, enables):
    assert tls_enables_cuda(tls) is enables


def test_tcp_only_tls_adds_cuda_copy_only_where_there_is_a_gpu():
    assert tcp_only_tls(0) == "tcp"
    assert tcp_only_tls(8) == "tcp,cuda_copy"
    assert tls_enables_cuda(tcp_only_tls(1))


def test_backend_start_hint_names_ucx_tls_only_where_nixl_would_refuse_it():
    hint = backend_start_hint("UCX", {"UCX_TLS": "tcp"}, gpus=1)
    assert "UCX_TLS='tcp'" in hint and "1 NVIDIA GPU" in hint and "'tcp,cuda_copy'" in hint
    assert backend_start_hint("UCX", {"UCX_TLS": "tcp"}, gpus=0) == ""
    assert backend_start_hint("UCX", {"UCX_TLS": "tcp,cuda_copy"}, gpus=1) == ""
    assert backend_start_hint("UCX", {}, gpus=1) == ""
    assert backend_start_hint("GDS", {"UCX_TLS": "tcp"}, gpus=1) == ""
