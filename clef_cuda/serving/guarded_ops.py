"""The op library the serving trunk runs on: clef_cuda.ops with every kernel that failed on this device kept
from running, and a CUDA fault named by the kernel that raised it.

A kernel "fails" when it crashed or hung its trial process, left a sticky CUDA error there, could not
launch (no kernel image for this card, too many resources), or faulted while serving (clef_cuda.serving.trial,
the autotune's cache). Its op then runs the reference twin (clef_cuda.reference: pure torch, the same
signature): slower, right. paged_attention's "auto" dispatch is steered to the SIMT kernel when the tensor-core
one failed (and to the reference when both did); a forced failed kernel is a ValueError.

What a CUDA error means is clef_cuda.serving.cuda_errors' to say, from the error itself. A launch error (no
kernel image for this card, too many resources) leaves the context usable: the kernel is marked failed (and the
on_failure callback persists it), and the call runs again on the reference. A sticky one (an illegal or
misaligned address, a device-side trap) destroys the CUDA context: no further GPU work can run in this process,
so it is raised as KernelFault naming the op and kernel, which the server turns into a recorded failure and a
non-zero exit (the next start skips the kernel). An out-of-memory or a busy device is no kernel's fault: it is
raised as it is (the step fails, the server serves on) and nothing is recorded. Errors are asynchronous: a fault
surfaces at the next launch or synchronisation, which may be in torch's own code; `last_launch` names the last
of our kernels launched before it, the prime suspect. With CUDA_LAUNCH_BLOCKING=1 the op that raised is the one
that faulted.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from clef_cuda import reference
from clef_cuda.ops import KERNEL_OPS
from clef_cuda.serving.cuda_errors import LAUNCH, STICKY, classify, first_line

log = logging.getLogger("clef_cuda.serving.guarded_ops")

# The ops the trunk, the self-check and the autotune call, besides paged_attention (a choice of kernels).
GUARDED_OPS = tuple(op for op in KERNEL_OPS if op != "paged_attention")


class KernelFault(RuntimeError):
    """A sticky CUDA error: the context is gone. `kernel` is "op:kernel" (e.g. "paged_attention:wmma2")."""

    def __init__(self, kernel: str, error: str, surfaced_in: str | None = None) -> None:
        self.kernel, self.error, self.surfaced_in = kernel, error, surfaced_in
        where = "" if surfaced_in in (None, kernel) else f", surfacing in {surfaced_in}"
        super().__init__(f"CUDA fault in {kernel.replace(':', ' (kernel ', 1)}){where}: {error}")


def as_kernel_fault(error: BaseException, ops) -> KernelFault | None:
    """The KernelFault `error` is: itself, or a sticky CUDA error that surfaced outside our ops (in torch's code),
    pinned on the last of our kernels `ops` launched; None for any other error."""
    if isinstance(error, KernelFault):
        return error
    if classify(error) != STICKY:
        return None
    suspect = getattr(ops, "last_launch", None) or "unknown:unknown"
    return KernelFault(suspect, first_line(error), surfaced_in="torch")


def kernel_name(op: str, tensor: torch.Tensor | None) -> str:
    """'op:cuda' or 'op:cpu': where one implementation of an op runs."""
    return f"{op}:{'cuda' if tensor is not None and tensor.device.type == 'cuda' else 'cpu'}"


def _first_tensor(args) -> torch.Tensor | None:
    return next((a for a in args if isinstance(a, torch.Tensor)), None)


class GuardedOps:
    """An op library over `base` (clef_cuda.ops, or a test's) that never runs a kernel in `failed`
    ("op:kernel" -> why) and reports faults by kernel. `on_failure(kernel, why)` is called when a launch
    error marks a kernel failed while serving (the autotune persists it)."""

    def __init__(
        self,
        base,
        failed: dict[str, str] | None = None,
        on_failure: Callable[[str, str], None] | None = None,
        fallback=reference,
    ) -> None:
        self.base, self.fallback = base, fallback
        self.failed: dict[str, str] = dict(failed or {})
        self.on_failure = on_failure
        self.last_launch: str | None = None

    def __getattr__(self, name: str):
        if name in GUARDED_OPS:
            return lambda *args, **kwargs: self._call(name, kernel_name(name, _first_tensor(args)), args, kwargs)
        return getattr(self.base, name)  # paged_attention_dispatch, paged_attention_tiles, cpu_isa, ...

    # ---- one op call ------------------------------------------------------------------------------
    def _call(self, op: str, kernel: str, args, kwargs, run=None):
        if kernel in self.failed:
            return getattr(self.fallback, op)(*args, **kwargs)
        self.last_launch = kernel
        try:
            return (run or getattr(self.base, op))(*args, **kwargs)
        except Exception as error:
            kind = classify(error)
            if kind == STICKY:
                raise KernelFault(kernel, first_line(error)) from error
            if kind != LAUNCH:  # out of memory, a busy device, not a CUDA error: no kernel's fault
                raise
            self.mark_failed(kernel, f"could not launch: {first_line(error)}")
            return getattr(self.fallback, op)(*args, **kwargs)

    def mark_failed(self, kernel: str, why: str) -> None:
        if kernel in self.failed:
            return
        self.failed[kernel] = why
        log.error("kernel %s failed on this device (%s): its op runs the reference from now on", kernel, why)
        if self.on_failure is not None:
            self.on_failure(kernel, why)

    # ---- paged attention: a choice of kernels -------------------------------------------------------
    def paged_attention(self, query, key_cache, value_cache, cu_seqlens_q, context_lens, block_tables, **kwargs):
        args = (query, key_cache, value_cache, cu_seqlens_q, context_lens, block_tables)
        if query.device.type != "cuda":
            return self._call("paged_attention", "paged_attention:cpu", args, kwargs)
        requested = kwargs.pop("kernel", "auto")
        kernel = self._attention_kernel(args, requested)
        if kernel is None:
            return self.fallback.paged_attention(*args, **kwargs)
        self.last_launch = f"paged_attention:{kernel}"
        try:
            return self.base.paged_attention(*args, kernel=kernel, **kwargs)
        except Exception as error:
            kind = classify(error)
            if kind not in (STICKY, LAUNCH):
                raise
            name = self._dispatched(args) if kernel == "auto" else f"paged_attention:{kernel}"
            if kind == STICKY:
                raise KernelFault(name, first_line(error)) from error
            self.mark_failed(name, f"could not launch: {first_line(error)}")
            return self.paged_attention(*args, kernel=requested, **kwargs)  # steered around it now

    def _attention_kernel(self, args, requested: str) -> str | None:
        """The kernel to force ("auto" when nothing failed), or None: run the reference."""
        if requested != "auto":
            name = f"paged_attention:{requested}"
            if name in self.failed:
                raise ValueError(f"paged_attention: kernel={requested!r} failed on this device: {self.failed[name]}")
            return requested
        if "paged_attention:auto" in self.failed:
            return None
        if not any(name.startswith("paged_attention:") for name in self.failed):
            return "auto"
        # The dispatch rule's pick, steered around a failed kernel: the SIMT kernel runs every call the
        # tensor-core one can; with both failed, the reference.
        picked = self.base.paged_attention_dispatch(*args)
        if f"paged_attention:{picked}" not in self.failed:
            return picked
        return None if picked == "simt" or "paged_attention:simt" in self.failed else "simt"

    def _dispatched(self, args) -> str:
        """'paged_attention:<the kernel auto ran>' (a host-side question, answerable after a fault)."""
        try:
            return f"paged_attention:{self.base.paged_attention_dispatch(*args)}"
        except Exception:
            return "paged_attention:auto"
