"""Telling a lost GPU from a failed job.

After a DirectML device removal or reset (a driver update, a TDR, an eGPU unplugged) or a sticky
CUDA error, every later ``Run`` on the session fails: the worker must not fail job after job with
it, nor retry them on the same session. It puts its jobs back and exits with EXIT_DEVICE_LOST,
and its supervisor starts a fresh process. ONNX Runtime raises these as plain RuntimeErrors
(``Fail``/``RuntimeException``), so the error's text is all there is to go by.
"""

from __future__ import annotations

import re

#: Texts ONNX Runtime's DirectML and CUDA providers put in the errors of a lost device.
DEVICE_LOST_PATTERNS = (
    # DXGI_ERROR_DEVICE_REMOVED / _HUNG / _RESET / _DRIVER_INTERNAL_ERROR, by name and by HRESULT.
    r"DXGI_ERROR_DEVICE_(REMOVED|HUNG|RESET)",
    r"DXGI_ERROR_DRIVER_INTERNAL_ERROR",
    # HRESULTs as DirectML's exceptions print them: "887A0005 The GPU device instance has been suspended."
    r"\b(0x)?887A000[567]\b",
    r"\b(0x)?887A0020\b",
    r"GPU device instance has been suspended",
    r"device (was )?removed",
    r"device (is )?hung",
    # CUDA errors that leave the context unusable ("sticky" errors).
    r"cudaErrorIllegalAddress|an illegal memory access was encountered",
    r"cudaErrorLaunchFailure|unspecified launch failure",
    r"cudaErrorECCUncorrectable|uncorrectable ECC error",
    r"cudaErrorDevicesUnavailable|cudaErrorNoDevice|no CUDA-capable device is detected",
    r"GPU has fallen off the bus",
    r"CUDA_ERROR_(ILLEGAL_ADDRESS|LAUNCH_FAILED|ECC_UNCORRECTABLE|DEVICE_UNAVAILABLE)",
)


class DeviceLostMatcher:
    """``matcher(exc)``: whether an error from ``session.run`` means the device is gone.

    ``extra`` is a regular expression of the operator's own (``--device-lost-pattern``), for a
    driver whose message is not listed here.
    """

    def __init__(self, extra: str | None = None) -> None:
        patterns = [*DEVICE_LOST_PATTERNS, *([extra] if extra else [])]
        self._regex = re.compile("|".join(f"(?:{p})" for p in patterns), re.IGNORECASE)

    def __call__(self, exc: BaseException) -> bool:
        return self._regex.search(f"{type(exc).__name__}: {exc}") is not None
