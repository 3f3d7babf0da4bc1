"""The op library the serving trunk runs on: clef_cuda.kernels.ops with every kernel that failed on this device kept
from running, and a CUDA fault named by the kernel that raised it.

A kernel "fails" when it crashed or hung its trial process, left a sticky CUDA error there, could not
launch (no kernel image for this card, too many resources), or faulted while serving (clef_cuda.tuning.trials,
the autotune's cache). Its op then runs the reference twin (clef_cuda.kernels.reference: pure torch, the same
signature): slower, right. The ops with a choice of CUDA kernels are steered around a failed one: paged_attention's
"auto" to the SIMT kernel when a tensor-core one failed, gated_delta_rule_chunk's to the token-serial kernel when
the chunked one failed (each to the reference when both did); a forced failed kernel is a ValueError.

What a CUDA error means is clef_cuda.runtime.cuda_errors' to say, from the error itself. A launch error (no
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

from clef_cuda.kernels import reference
from clef_cuda.kernels.ops import KERNEL_OPS
from clef_cuda.runtime.cuda_errors import LAUNCH, STICKY, classify, first_line

log = logging.getLogger("clef_cuda.verification.guarded_ops")

# Ops with a choice of CUDA kernels: the op that says which one "auto" runs (and the arguments it takes, by
# position in the op's), and the kernel that runs every call the others can.
KERNEL_CHOICES = {
    "paged_attention": ("paged_attention_dispatch", (0, 1, 2, 3, 4, 5), "simt"),
    "gated_delta_rule_chunk": ("gated_delta_rule_dispatch", (0, 2, 6), "serial"),
}
# The ops the trunk, the self-check and the autotune call, besides those (one kernel a device).
GUARDED_OPS = tuple(op for op in KERNEL_OPS if op not in KERNEL_CHOICES)


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
    """An op library over `base` (clef_cuda.kernels.ops, or a test's) that never runs a kernel in `failed`
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

    # ---- ops with a choice of kernels -----------------------------------------------------------------
    def paged_attention(self, query, key_cache, value_cache, cu_seqlens_q, context_lens, block_tables, **kwargs):
        args = (query, key_cache, value_cache, cu_seqlens_q, context_lens, block_tables)
        return self._choice("paged_attention", args, kwargs)

    def gated_delta_rule_chunk(self, q, k, v, g, beta, states, cu_seqlens, state_indices, has_initial_state, **kwargs):
        args = (q, k, v, g, beta, states, cu_seqlens, state_indices, has_initial_state)
        return self._choice("gated_delta_rule_chunk", args, kwargs)

    def _choice(self, op: str, args, kwargs):
        if args[0].device.type != "cuda":
            return self._call(op, f"{op}:cpu", args, kwargs)
        requested = kwargs.pop("kernel", "auto")
        kernel = self._steered(op, args, requested)
        if kernel is None:
            return getattr(self.fallback, op)(*args, **kwargs)
        self.last_launch = f"{op}:{kernel}"
        try:
            return getattr(self.base, op)(*args, kernel=kernel, **kwargs)
        except Exception as error:
            kind = classify(error)
            if kind not in (STICKY, LAUNCH):
                raise
            name = self._dispatched(op, args) if kernel == "auto" else f"{op}:{kernel.split(':')[0]}"
            if kind == STICKY:
                raise KernelFault(name, first_line(error)) from error
            self.mark_failed(name, f"could not launch: {first_line(error)}")
            return self._choice(op, args, dict(kwargs, kernel=requested))  # steered around it now

    def _steered(self, op: str, args, requested: str) -> str | None:
        """The kernel to force ("auto" when nothing failed), or None: run the reference."""
        universal = KERNEL_CHOICES[op][2]
        if requested != "auto":
            # a variant ("chunked:s64") has failed when its kernel has
            for name in (f"{op}:{requested}", f"{op}:{requested.split(':')[0]}"):
                if name in self.failed:
                    raise ValueError(f"{op}: kernel={requested!r} failed on this device: {self.failed[name]}")
            return requested
        if f"{op}:auto" in self.failed:
            return None
        if not any(name.startswith(f"{op}:") for name in self.failed):
            return "auto"
        # The dispatch rule's pick, steered around a failed kernel: the universal one (SIMT attention, the
        # serial delta rule) runs every call the others can; with it failed too, the reference.
        picked = self._dispatched(op, args).split(":", 1)[1]
        if f"{op}:{picked}" not in self.failed:
            return picked
        return None if picked == universal or f"{op}:{universal}" in self.failed else universal

    def _dispatched(self, op: str, args) -> str:
        """'op:<the kernel auto runs>' (a host-side question, answerable after a fault)."""
        dispatch, positions, _ = KERNEL_CHOICES[op]
        try:
            return f"{op}:{getattr(self.base, dispatch)(*(args[i] for i in positions))}"
        except Exception:
            return f"{op}:auto"
