"""The toolchain report (cudabuild.backend.toolchain): what it keys, and the pairing it warns of."""

from __future__ import annotations

from cudabuild.backend import toolchain


def test_a_torch_outside_what_executorch_declares_is_one_line():
    # The GPU image's pairing: executorch 1.4.1 declares torch>=2.13, the image has 2.11.
    line = toolchain.unsupported_pairing("executorch", "torch", "2.11.0+cu130")
    assert line == ("executorch 1.4.1 declares torch>=2.13.0a0, and this is torch 2.11.0+cu130: a failure seen "
                    "only here may come from that pairing")
    assert toolchain.unsupported_pairing("executorch", "torch", "2.13.0+cpu") is None
    assert toolchain.unsupported_pairing("no-such-package", "torch", "2.11.0") is None


def test_the_quantizer_and_kernel_libraries_are_in_the_cheap_fingerprint():
    packages = toolchain.cheap_fingerprint("cpu")["packages"]
    assert set(packages) == {"torch", "triton", "executorch", "torchao", "fla-core"}
    assert packages["torchao"] == toolchain.package_version("torchao")
