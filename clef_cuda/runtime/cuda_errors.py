"""What a CUDA error means for the process that met it: the one classifier every fail-safe asks (the guarded op
library, the kernel trials, the engine, the tensor-parallel ranks).

The kind is read from the error itself, the CUDA runtime's own words (cudaGetErrorString, which torch and our
launchers both pass on) or its type (torch.OutOfMemoryError), never from the wording we wrap it in: our
launchers prefix every failure with "<op>: CUDA launch failed:", whatever the cause.

  sticky         the CUDA context is gone (an illegal or misaligned address, a device-side assert or trap, an
                 uncorrectable ECC error, ...): nothing can run on the device in this process again, so the
                 kernel is recorded as failed and the process exits for a clean one.
  launch         this kernel cannot run on this device (no kernel image for its architecture, too many
                 resources, an invalid launch configuration); the context is fine: the kernel is marked failed
                 and its op runs the reference.
  out-of-memory  the call could not get memory now; neither the kernel nor the context is at fault: the call
                 (its step, its request) fails and the server serves on.
  transient      the device is busy or not ready (an exclusive-process GPU held by another process, a device
                 being reset): nothing is recorded against any kernel; the work fails and may be tried again.
  None           not a CUDA runtime error at all: a bad argument, a launcher refusing a shape, a bug of ours.
"""

from __future__ import annotations

import torch

STICKY, LAUNCH, OUT_OF_MEMORY, TRANSIENT = "sticky", "launch", "out-of-memory", "transient"

# Lower-case cudaGetErrorString texts (and their cudaError* names) by kind. Sticky: cudaErrorIllegalAddress,
# cudaErrorMisalignedAddress, cudaErrorLaunchFailure, cudaErrorIllegalInstruction, cudaErrorAssert,
# cudaErrorHardwareStackError, cudaErrorLaunchTimeout, cudaErrorECCUncorrectable, cudaErrorInvalidPc,
# cudaErrorInvalidAddressSpace, cudaErrorTrap-like "unspecified launch failure".
_STICKY = (
    "illegal memory access",
    "illegal address",
    "misaligned address",
    "unspecified launch failure",
    "illegal instruction",
    "device-side assert",
    "hardware stack error",
    "launch timed out",
    "uncorrectable ecc",
    "invalid program counter",
    "invalid address space",
    "an exception occurred on the device",
    "cudaerrorillegaladdress",
    "cudaerrormisalignedaddress",
    "cudaerrorlaunchfailure",
    "cudaerrorassert",
)
# cudaErrorNoKernelImageForDevice, cudaErrorLaunchOutOfResources, cudaErrorInvalidDeviceFunction,
# cudaErrorSymbolNotFound, cudaErrorInvalidConfiguration, cudaErrorInvalidKernelImage, cudaErrorInvalidPtx,
# cudaErrorUnsupportedPtxVersion.
_LAUNCH = (
    "no kernel image is available",
    "too many resources requested for launch",
    "invalid device function",
    "named symbol not found",
    "invalid configuration argument",
    "device kernel image is invalid",
    "a ptx jit compilation failed",
    "the provided ptx was compiled with an unsupported toolchain",
    "cudaerrornokernelimagefordevice",
    "cudaerrorlaunchoutofresources",
)
# cudaErrorMemoryAllocation and torch's caching allocator ("CUDA out of memory. Tried to allocate ...").
_OUT_OF_MEMORY = ("out of memory", "cudaerrormemoryallocation")
# cudaErrorDevicesUnavailable (exclusive-process mode), cudaErrorNotReady, cudaErrorSystemNotReady,
# cudaErrorCudartUnloading.
_TRANSIENT = (
    "busy or unavailable",
    "device not ready",
    "system not yet initialized",
    "driver shutting down",
    "cudaerrordevicesunavailable",
)


def classify(error: BaseException) -> str | None:
    """STICKY, LAUNCH, OUT_OF_MEMORY, TRANSIENT, or None (not a CUDA runtime error). Sticky is asked first: an
    error chain that mentions a lost context is a lost context, whatever else it says."""
    if isinstance(error, torch.OutOfMemoryError):
        return OUT_OF_MEMORY
    text = str(error).lower()
    for kind, markers in (
        (STICKY, _STICKY),
        (LAUNCH, _LAUNCH),
        (OUT_OF_MEMORY, _OUT_OF_MEMORY),
        (TRANSIENT, _TRANSIENT),
    ):
        if any(marker in text for marker in markers):
            return kind
    return None


def first_line(error: BaseException, limit: int = 200) -> str:
    """The error's first line (its type's name when it has no text), at most `limit` characters."""
    text = str(error).strip().splitlines()
    return (text[0] if text else type(error).__name__)[:limit]
