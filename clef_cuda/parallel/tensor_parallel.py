"""Tensor parallel over the cards of one machine: clef-serve --tensor-parallel-size N starts N - 1 worker
processes (no torchrun), one per card; every rank holds its shard of the trunk (clef_cuda.model.shard) and
runs its part of every trunk call on the same batch, its share of the vocabulary tables' rows included; rank 0
(the server process) serves HTTP, schedules and runs the joint head; the last rank holds and runs the vision
tower (RemoteVisionTower: the images go there, the features come back to rank 0's host memory).

Start: the workers are started first (clef_cuda.runtime.children: one start budget, their liveness polled, every
one reaped on every way out, each dying with rank 0) and load their shards while rank 0 loads its own. Each
reports "ready" (loaded, its self-check passed) on its command channel; only then do the ranks rendezvous
(torch.distributed over a TCPStore rank 0 opened when it started them), so a worker that dies or hangs while
loading is seen at once, never waited on in a rendezvous. Start failures are TensorParallelLost (fatal: the
server exits non-zero).

Two channels between rank 0 and each worker:
  commands   a socket pair (multiprocessing.connection): rank 0 sends each call before it makes it (Trunk.peers:
             forward, an MLP replay, vocabulary rows, images for the tower, a cache allocated, a state slot
             copied, the kernel decisions, stop); the
             worker answers each call once it is done on its device: ok, or failed (why), with any kernel its
             guarded op library marked failed meanwhile. A worker waits for commands without a timeout (an idle
             server is not a fault) and exits when the channel closes (rank 0 gone).
  tensors    torch.distributed (NCCL on CUDA, gloo on the CPU): all-reduces (Trunk.collectives): each step's
             embedded rows (each rank's share of the vocabulary), one after each mixer and each MLP, and the
             joint head's option rows of the LM-head table.

Lock-step. Rank 0 makes one call at a time, whichever thread makes it (the scheduler's steps and shadow
passes, the head thread's option rows): two calls at once would pair one's all-reduces with the other's.
Every call has a fixed schedule of collectives (collective_schedule). A rank whose call raises part
way (an out-of-memory, an error of its own) still makes the rest of that call's collectives, with zeros
(_Collectives.drain), so no rank is left waiting inside a collective and the next call pairs up; then every
rank has finished the call, and rank 0 learns from the answers which failed. A failed call fails its step's
records on rank 0 (StepFailedOnRank, or rank 0's own error) and the group serves on; a request-level error such
as an f16 overflow, raised by every rank at the same point, does the same. A sticky CUDA fault on a worker is
reported (its kernel) before the worker exits: the server records the kernel and restarts without it.

Bounded waits, on NCCL as on gloo: collectives are issued asynchronously; on the CPU each is awaited by polling
with the deadline, on a GPU each is ordered on the stream and the call's end is awaited by polling a CUDA event
with the deadline (the backend's own timeout, NCCL's watchdog or gloo's, is set later, so it never fires first;
a collective gloo completes with an error, a peer gone, is raised as failed). A worker that exits, a call whose
answers or device work outlast --tensor-parallel-timeout (a hung rank), or a collective that fails marks the
group lost: on_lost(reason) is called once (the server turns /ready 503 and exits 5), and
every later call raises TensorParallelLost instead of hanging.

What runs on the workers: the fast ops on the same guarded op library and kernel decisions as rank 0 (the
autotune's report, sent when rank 0 installs it), the reference ops (for shadow runs) and the self-check on
their own shard at start-up (a failure is the worker's exit, with its report). LoRA variants are refused.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import pickle
import re
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from multiprocessing.connection import Connection
from pathlib import Path
from types import SimpleNamespace

import torch

from clef_cuda.errors import ClefError
from clef_cuda.runtime.children import (
    POLL_S,
    START_TIMEOUT_S,
    Child,
    ChildFailed,
    die_with_parent,
    reap_all,
    wait_for,
)
from clef_cuda.runtime.cuda_errors import STICKY, classify, first_line
from clef_cuda.verification.guarded_ops import KernelFault

log = logging.getLogger("clef_cuda.parallel.tensor_parallel")

TP_TIMEOUT_S = 60.0  # a call whose collectives or answers take longer: a hung rank, the group is lost
RENDEZVOUS_TIMEOUT_S = 60.0  # every rank loaded and ready: joining the group takes seconds
BACKEND_TIMEOUT_GRACE_S = 30.0  # NCCL's watchdog and gloo time out at ours plus this: our own deadline fires first
EXIT_WORKER_FAILED = 3  # a worker that could not start (its report says why)
EXIT_WORKER_FAULT = 4  # a worker whose CUDA context a kernel destroyed (it reported the kernel first)
# The command that starts a worker rank (its flags follow). Never read from the environment: only a test's own
# launcher replaces it, with a script that installs a fault on that rank and then runs worker_main()
# (tests/tp_worker_faults.py).
WORKER_COMMAND: tuple[str, ...] = (sys.executable, "-m", "clef_cuda.parallel.tensor_parallel")


class TensorParallelLost(ClefError):
    """A rank died, hung or failed a collective: the group cannot run another step. `kernel_fault`: the sticky
    CUDA fault a worker reported before it exited (the server records its kernel)."""

    fatal = True  # the engine stops on it (nothing can run again) instead of failing one pack

    def __init__(self, reason: str, kernel_fault=None) -> None:
        super().__init__(reason)
        self.kernel_fault = kernel_fault


class StepFailedOnRank(ClefError):
    """A worker's part of a call raised (its out-of-memory, an error of its own); every rank finished the call in
    lock-step: the step's records fail, the group serves on."""


def collective_schedule(call: str, rows: int, hidden: int, num_layers: int, dtype: torch.dtype) -> list:
    """The collectives one call makes, in order, as (kind, shape, dtype): a forward all-reduces the ranks' shares
    of its embedded rows (fp32) and each mixer's and each MLP's output (serving dtype); an MLP replay and a
    lookup of vocabulary rows all-reduce their output; the other calls make none."""
    if call == "forward":
        return [("all_reduce", (rows, hidden), torch.float32)] + [("all_reduce", (rows, hidden), dtype)] * (
            2 * num_layers
        )
    if call in ("mlp", "vocab_rows"):
        return [("all_reduce", (rows, hidden), dtype)]
    return []


class _Collectives:
    """Trunk.collectives over a torch.distributed group, following each call's schedule (so a rank that failed
    part way can finish it: drain); any failure of a collective itself marks the group lost."""

    def __init__(self, group, device: torch.device, timeout: float, on_lost: Callable[[str], None]) -> None:
        self.group, self.device, self.timeout, self.on_lost = group, device, timeout, on_lost
        self.lost: str | None = None
        self.call = ""
        self.schedule: list = []
        self.done = 0

    def begin(self, call: str, schedule: list) -> None:
        self.call, self.schedule, self.done = call, schedule, 0

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        self._run("all_reduce", tensor, lambda t: dist.all_reduce(t, group=self.group, async_op=True))
        return tensor

    def drain(self) -> None:
        """The rest of the call's collectives with zeros: this rank failed part way, the others must not wait."""
        while self.done < len(self.schedule):
            kind, shape, dtype = self.schedule[self.done]
            getattr(self, kind)(torch.zeros(shape, dtype=dtype, device=self.device))

    def _run(self, kind: str, tensor: torch.Tensor, op) -> None:
        if self.lost is not None:
            raise TensorParallelLost(self.lost)
        # Lock-step needs every rank to make the same collectives as the call's schedule says (drain relies on it).
        expected = self.schedule[self.done] if self.done < len(self.schedule) else None
        if self.schedule and (kind, tuple(tensor.shape), tensor.dtype) != expected:
            raise RuntimeError(
                f"collective {self.done} of the call is {kind} {tuple(tensor.shape)} {tensor.dtype}; its schedule "
                f"says {expected}"
            )
        staged = tensor if tensor.is_contiguous() else tensor.contiguous()
        try:
            work = op(staged)
            if self.device.type == "cuda":
                work.wait()  # ordered on the stream; the call's end is awaited with the deadline (settle)
            else:
                what = f"collective {self.done + 1} of {len(self.schedule)} of a {self.call or 'call'}"
                _await(work.is_completed, time.monotonic() + self.timeout, what)
                # Gloo completes a collective whose peer is gone, with an error and the tensor left as this
                # rank's share: wait() raises that error (unchecked, the call went on with a partial sum).
                work.wait()
        except TensorParallelLost as error:
            self._lose(str(error))
            raise
        except Exception as error:  # gloo / NCCL: a peer gone, or the group's own timeout
            # (gloo's message starts with its source file and line: "[/__w/pytorch/.../pair.cc:561] Connection...")
            said = re.sub(r"^\[[^\]]*\]\s*", "", first_line(error, 400))
            reason = f"a tensor-parallel collective failed: {said[:200]}"
            self._lose(reason)
            raise TensorParallelLost(reason) from error
        self.done += 1
        if staged is not tensor:
            tensor.copy_(staged)

    def settle(self) -> None:
        """On a GPU: wait, with the deadline, for the device work the call queued (its collectives included)."""
        if self.device.type != "cuda":
            return
        event = torch.cuda.Event()
        event.record()
        try:
            _await(event.query, time.monotonic() + self.timeout, "the call's device work")
        except TensorParallelLost as error:
            self._lose(str(error))
            raise

    def _lose(self, reason: str) -> None:
        if self.lost is None:
            self.lost = reason
            self.on_lost(reason)


def _await(done: Callable[[], bool], deadline: float, what: str) -> None:
    """Poll done() until it is true; TensorParallelLost past `deadline` (a hung rank). Spins briefly, then backs
    off to a millisecond between looks."""
    pause, started = 0.0, time.monotonic()
    while not done():
        if time.monotonic() > deadline:
            raise TensorParallelLost(
                f"{what} did not finish within the tensor-parallel timeout ({deadline - started:.0f} s): a rank hung"
            )
        time.sleep(pause)
        pause = min(1e-3, pause * 2 or 1e-5)


def _batch_message(batch) -> dict:
    """A ChunkBatch as host tensors (the workers rebuild it on their device): the rows image features replace,
    not the features (rank 0 adds them; the workers' share of those rows is zeros)."""
    fields = ("input_ids", "positions", "cu_seqlens", "state_slots", "has_initial_state", "slot_mapping")
    message = {name: getattr(batch, name).cpu() for name in fields + ("block_tables", "context_lens")}
    if batch.override_rows is not None:
        message["override_rows"] = batch.override_rows.cpu()
    message["q_lens"], message["context_lengths"] = batch.q_lens, batch.context_lengths
    return message


def _batch_from(message: dict, device: torch.device):
    from clef_cuda.model.trunk import ChunkBatch

    tensors = {k: v.to(device) for k, v in message.items() if isinstance(v, torch.Tensor)}
    return ChunkBatch(**tensors, q_lens=message["q_lens"], context_lengths=message["context_lengths"])


def _message(trunk, call: str, args) -> tuple:
    """What a worker needs to make `call`: (call, ops name, rows for the schedule, arguments)."""
    if call == "forward":
        batch, cache, lora, _ = args
        if lora is not None:
            raise TensorParallelLost("LoRA variants are not sharded across tensor-parallel ranks")
        return (call, trunk.ops_name, batch.input_ids.shape[0], _batch_message(batch), cache.name)
    if call == "mlp":
        index, h = args
        return (call, trunk.ops_name, h.shape[0], index, h.cpu())
    if call == "vocab_rows":
        table, ids = args
        return (call, trunk.ops_name, ids.shape[0], table, ids.cpu())
    if call == "copy_slot":
        cache, destination, source = args
        return (call, trunk.ops_name, 0, cache.name, destination, source)
    if call == "vision":  # the prepared images, pixels by value: the tower's rank runs them
        (images,) = args
        return (call, trunk.ops_name, 0, list(images))
    return (call, trunk.ops_name, 0, *args)  # allocate_cache, install, selfcheck


class TensorParallel:
    """Rank 0's side: the workers, the command channels, the collectives (Trunk.peers implements call())."""

    def __init__(self, size: int, on_lost: Callable | None = None, timeout: float = TP_TIMEOUT_S) -> None:
        # on_lost(reason, kernel_fault): called once when the group is lost (kernel_fault: a worker's sticky fault)
        self.size, self.timeout, self.on_lost = size, timeout, on_lost
        self.lost: str | None = None
        self.lost_fault = None  # the KernelFault a worker reported before it exited
        self.workers: list[Child] = []
        self.channels: list[Connection] = []
        self.collectives: _Collectives | None = None
        self.on_kernel_failed: Callable[[str, str], None] | None = None  # a worker's launch failure, to record
        self._lock = threading.Lock()
        self._read_lock = (
            threading.Lock()
        )  # the engine thread reads answers; the watch thread a dead worker's last word
        # One call at a time, from whichever thread makes it: the engine thread's trunk steps and the head
        # thread's vocabulary rows (the joint head of a finished record runs beside the next step) interleaved
        # their messages and collectives, pairing one call's all-reduce with another's (a hang, or sums of the
        # wrong rows where the shapes agree).
        self._call_lock = threading.Lock()
        self._stopping = False
        self._store = None
        self._launched = 0.0
        self._threads_before: int | None = None  # rank 0's intra-op threads before a CPU group shared them

    # ---- start-up ------------------------------------------------------------------------------------
    def launch(
        self,
        release: str | Path,
        device: torch.device,
        dtype: torch.dtype,
        quantize: str,
        vocab_tables: str,
        vocab_split: list[tuple[int, int]],
    ) -> None:
        """Start the workers: each loads its shard, its rows of the vocabulary tables (vocab_split[rank], where
        `vocab_tables` says) included, while rank 0 loads its own."""
        import torch.distributed as dist

        self._store = dist.TCPStore("127.0.0.1", 0, self.size, is_master=True, wait_for_workers=False)
        self._launched = time.monotonic()
        self.device = device
        threads = self._share_cores() if device.type == "cpu" else 0
        try:
            for rank in range(1, self.size):
                ours, theirs = socket.socketpair()
                worker_device = f"cuda:{(device.index or 0) + rank}" if device.type == "cuda" else "cpu"
                argv = [*WORKER_COMMAND, "--rank", str(rank)]
                argv += [
                    "--size",
                    str(self.size),
                    "--port",
                    str(self._store.port),
                    "--control-fd",
                    str(theirs.fileno()),
                ]
                argv += ["--release", str(release), "--device", worker_device, "--parent", str(os.getpid())]
                argv += [
                    "--dtype",
                    str(dtype).removeprefix("torch."),
                    "--quantize",
                    quantize,
                    "--vocab-tables",
                    vocab_tables,
                    "--vocab-rows",
                    "{}:{}".format(*vocab_split[rank]),
                    "--timeout",
                    str(self.timeout),
                    "--threads",
                    str(threads),
                ]
                self.workers.append(Child(f"tensor-parallel rank {rank}", argv, pass_fds=(theirs.fileno(),)))
                theirs.close()
                self.channels.append(Connection(os.dup(ours.fileno())))
                ours.close()
        except BaseException:
            self.stop()
            raise
        threading.Thread(target=self._watch, name="clef-tp-watch", daemon=True).start()

    def _share_cores(self) -> int:
        """On the CPU every rank computes on the same cores: each gets an equal share of rank 0's intra-op threads
        (at least one), rank 0 included, until stop(). Each rank with the whole pool had 4 ranks on 2 cores
        run 8 threads, and every collective waited for ranks the others' threads kept off the cores: TP=4 served
        3.7x slower than with a share each (tests/test_tensor_parallel.py's corpus, 2 cores)."""
        self._threads_before = torch.get_num_threads()
        share = max(1, self._threads_before // self.size)
        torch.set_num_threads(share)
        log.info("tensor parallel on the CPU: %d ranks, %d intra-op thread(s) each", self.size, share)
        return share

    def join(self, device: torch.device) -> None:
        """Wait for every worker's report (its shard loaded), then rendezvous; TensorParallelLost (every
        worker reaped) if one failed, died, or did not report within the start budget. A worker loading as
        slowly as rank 0 did is not failed for it: the budget runs to START_TIMEOUT_S after the launch or
        RENDEZVOUS_TIMEOUT_S after rank 0 finished loading, whichever is later."""
        deadline = max(self._launched + START_TIMEOUT_S, time.monotonic() + RENDEZVOUS_TIMEOUT_S)
        try:
            for worker, channel in zip(self.workers, self.channels, strict=True):
                wait_for(lambda c=channel: c.poll(POLL_S), [worker], deadline, "ready (its shard loaded)", poll=0.0)
                status, detail = self._receive(channel, worker)
                if status != "ready":
                    raise ChildFailed(f"{worker.name} failed to start: {detail}")
                log.info("%s ready: %s", worker.name, detail)
            group = self._rendezvous(device)
        except (ChildFailed, TensorParallelLost) as error:
            self.stop()
            raise TensorParallelLost(str(error)) from error
        except BaseException:
            self.stop()
            raise
        self.collectives = _Collectives(group, device, self.timeout, self._collective_lost)

    def _rendezvous(self, device: torch.device):
        """Join the group as rank 0 on a thread, polling the workers meanwhile (one that dies is seen at once)."""
        joined: dict = {}

        def run() -> None:
            try:
                joined["group"] = _join(0, self.size, self._store, device, self.timeout)
            except BaseException as error:  # noqa: BLE001 (handed to the waiting thread)
                joined["error"] = error

        threading.Thread(target=run, name="clef-tp-rendezvous", daemon=True).start()
        wait_for(lambda: bool(joined), self.workers, time.monotonic() + RENDEZVOUS_TIMEOUT_S, "in the group")
        if "error" in joined:
            raise TensorParallelLost(f"the tensor-parallel rendezvous failed: {first_line(joined['error'])}")
        return joined["group"]

    def attach(self, trunk) -> None:
        """Make `trunk` (rank 0's shard) tell the workers each call and sum over the group."""
        trunk.peers = self
        trunk.collectives = self.collectives

    # ---- faults --------------------------------------------------------------------------------------
    def mark_lost(self, reason: str, fault=None) -> None:
        with self._lock:
            if self.lost is not None or self._stopping:
                self.lost_fault = self.lost_fault or fault
                return
            self.lost, self.lost_fault = reason, fault
        if self.collectives is not None and self.collectives.lost is None:
            self.collectives.lost = reason
        log.error("%s", reason)
        if self.on_lost is not None:
            self.on_lost(reason, self.lost_fault)

    def _collective_lost(self, reason: str) -> None:
        """A collective failed or timed out. A worker that met a sticky CUDA fault named its kernel on its way out,
        before its end of the group closed (which is what failed the collective): that fault is the reason, so that
        the server records the kernel (exit 4), as when the worker's answer or its exit is seen first."""
        for worker, channel in zip(self.workers, self.channels, strict=True):
            if (fault := self._reported_fault(worker, channel)) is not None:
                self.mark_lost(f"{worker.name}: {fault}", fault)
                return
        self.mark_lost(reason)

    def _watch(self) -> None:
        while not self._stopping and self.lost is None:
            for worker, channel in zip(self.workers, self.channels, strict=True):
                if not worker.alive() and not self._stopping:
                    self.mark_lost(
                        f"{worker.name} exited ({worker.how_ended()})", self._reported_fault(worker, channel)
                    )
                    return
            time.sleep(0.2)

    def _reported_fault(self, worker: Child, channel: Connection):
        """The sticky CUDA fault a worker reported on its way out, if it did (its last message; the group is lost:
        any other message it sent is read and dropped)."""
        with self._read_lock:
            try:
                while channel.poll(0):
                    message = pickle.loads(channel.recv_bytes())
                    if message[0] == "fault":
                        kernel, text = message[1]
                        return KernelFault(kernel, f"{text} (on {worker.name})")
            except (EOFError, OSError):
                pass
        return None

    def _lost_error(self) -> TensorParallelLost:
        return TensorParallelLost(self.lost or "the tensor-parallel group is lost", self.lost_fault)

    # ---- Trunk.peers ---------------------------------------------------------------------------------
    def call(self, trunk, call: str, args: tuple, local: Callable):
        """Make `call` on every rank: the workers are told first, rank 0 runs local(); every rank finishes the
        call's collectives even if its part raised (lock-step), then rank 0 waits, with the deadline, for its own
        device work and every worker's answer. Raises rank 0's own error, else StepFailedOnRank for a worker's, else
        returns local()'s result. Calls from several threads run one after another."""
        return self._call(trunk, call, args, local)[0]

    def workers_answer(self, trunk, call: str, args: tuple) -> list:
        """Make `call` on every rank (rank 0 has nothing to do); what each worker answered, in rank order."""
        return self._call(trunk, call, args, lambda: None)[1]

    def _call(self, trunk, call: str, args: tuple, local: Callable) -> tuple:
        with self._call_lock:
            return self._call_alone(trunk, call, args, local)

    def _call_alone(self, trunk, call: str, args: tuple, local: Callable) -> tuple:
        if self.lost is not None:
            raise self._lost_error()
        message = _message(trunk, call, args)
        payload = pickle.dumps(message)  # plain pickle: tensors by value (not torch's shared-memory handles)
        try:
            for channel in self.channels:
                channel.send_bytes(payload)
        except (OSError, EOFError) as error:
            self.mark_lost(f"a tensor-parallel worker stopped listening ({error})")
            raise self._lost_error() from error
        collectives = self.collectives
        c = trunk.config
        collectives.begin(call, collective_schedule(call, message[2], c.hidden_size, c.num_layers, trunk.dtype))
        error = result = None
        try:
            result = local()
        except TensorParallelLost as lost:  # a collective failed: the reason the group was lost (a fault?)
            raise self._lost_error() from lost
        except Exception as raised:  # rank 0's part failed: the others finish the call, then it fails here
            if classify(raised) == STICKY or isinstance(raised, KernelFault):
                raise  # no collective can run on this device again: the server records the kernel and exits
            error = raised
            collectives.drain()
        if error is None:
            collectives.settle()
        failures, answered = self._answers()
        if error is not None:
            raise error
        if failures:
            raise StepFailedOnRank("; ".join(failures))
        return result, answered

    def _answers(self) -> tuple[list[str], list]:
        """Every worker's answer to the call just made (within the deadline): the failures, in words, and what
        each answered."""
        deadline = time.monotonic() + self.timeout
        failures, answered = [], []
        for worker, channel in zip(self.workers, self.channels, strict=True):
            try:
                # channel.poll(POLL_S) returns the moment the answer is there; between slices, the worker's liveness
                wait_for(lambda c=channel: c.poll(POLL_S), [worker], deadline, "done with the call", poll=0.0)
                status, detail, news = self._receive(channel, worker)
            except ChildFailed as error:
                self.mark_lost(str(error))
                raise self._lost_error() from error
            for kernel, why in news.items():  # a launch failure on the worker: rank 0 records it too
                if self.on_kernel_failed is not None:
                    self.on_kernel_failed(kernel, f"{why} (on {worker.name})")
            if status == "fault":  # a sticky CUDA fault: the worker exits; the server records the kernel
                kernel, text = detail
                fault = KernelFault(kernel, f"{text} (on {worker.name})")
                self.mark_lost(f"{worker.name}: {fault}", fault)
                raise self._lost_error()
            if status == "failed":
                failures.append(f"{worker.name} failed the step: {detail}")
            answered.append(detail)
        return failures, answered

    def _receive(self, channel: Connection, worker: Child) -> tuple:
        try:
            with self._read_lock:
                return pickle.loads(channel.recv_bytes())
        except (EOFError, OSError) as error:
            worker.process.wait(5) if worker.alive() else None
            raise ChildFailed(f"{worker.name} {worker.how_ended()} (its channel closed)") from error

    def vision_tower(self, trunk) -> RemoteVisionTower:
        """Rank 0's handle on the vision tower its rank (tower_rank) loaded."""
        from clef_cuda.model.shard import tower_rank

        return RemoteVisionTower(self, trunk, tower_rank(self.size))

    def install(self, trunk, report, buckets, config) -> None:
        """The kernel decisions rank 0's autotune installed (failures, choices, the int8 policy's shapes) on every
        worker's trunk, so that every rank runs the same kernels."""
        shapes = {"max_num_seqs": config.max_num_seqs, "prefill_chunk_size": config.prefill_chunk_size}
        self.call(trunk, "install", (report.to_json(), [asdict(b) for b in buckets], shapes), lambda: None)

    def selfcheck(self, trunk, block_size: int) -> list:
        """Every worker's self-check on its shard, with the kernel decisions installed (rank, report) each."""
        return list(enumerate(self.workers_answer(trunk, "selfcheck", (block_size,)), 1))

    def stop(self, timeout: float = 30.0) -> None:
        """Tell every worker to exit, wait for them (killing any that do not), leave the group."""
        self._stopping = True
        for channel in self.channels:
            try:
                channel.send_bytes(pickle.dumps(("stop",)))
                channel.close()
            except (OSError, EOFError):
                pass
        reap_all(self.workers, timeout)
        import torch.distributed as dist

        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception as error:  # a group whose peers are gone may not destroy cleanly
                log.warning("leaving the tensor-parallel group: %s", first_line(error))
        if self._threads_before is not None:
            torch.set_num_threads(self._threads_before)
            self._threads_before = None


class RemoteVisionTower:
    """Rank 0's handle on the vision tower another rank holds (clef_cuda.model.shard.tower_rank), called as a
    VisionTower is: the prepared images go over the command channel with the call, the tower's rank answers
    with their features, which stay in rank 0's host memory (pinned on a GPU host: the engine keeps waiting
    features there, and its vision cache keeps these there too; a step copies its rows over). A failure is
    the call's: StepFailedOnRank for an error on the tower's rank (an out-of-memory: the records fail, the group
    serves on), TensorParallelLost for a dead or hung one."""

    def __init__(self, group: TensorParallel, trunk, rank: int) -> None:
        self.group, self.trunk, self.rank = group, trunk, rank

    def __call__(self, images) -> list[torch.Tensor]:
        if not images:
            return []
        features = self.group.workers_answer(self.trunk, "vision", (images,))[self.rank - 1]
        return [rows.pin_memory() for rows in features] if self.group.device.type == "cuda" else features


def _join(rank: int, size: int, store, device: torch.device, timeout: float):
    """Join the ranks (NCCL on CUDA, gloo on the CPU) as `rank` over `store`. The backend's own timeout (NCCL's
    watchdog, gloo's) is the tensor-parallel timeout plus a grace, so that our polled deadline fires first and a
    hung rank is named as one (gloo timing out first, at 5 s, failed the call as "unbound buffer" instead)."""
    import torch.distributed as dist

    grace = BACKEND_TIMEOUT_GRACE_S
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        store=store,
        rank=rank,
        world_size=size,
        timeout=datetime.timedelta(seconds=timeout + grace),
    )
    return dist.new_group(list(range(size)), timeout=datetime.timedelta(seconds=timeout + grace))


# ---- the worker process ----------------------------------------------------------------------------------
def _worker_ops(rank: int):
    """The op library a worker's fast trunk starts on (guarded by the caller: a launch failure routed to the
    reference and reported); a test's worker script replaces it to break one rank alone."""
    from clef_cuda.kernels import ops

    return ops


def worker_main(argv: list[str]) -> int:
    import signal

    parser = argparse.ArgumentParser(prog="clef_cuda.parallel.tensor_parallel")
    for name in ("--rank", "--size", "--port", "--control-fd", "--parent"):
        parser.add_argument(name, type=int, required=True)
    for name in ("--release", "--device", "--dtype", "--quantize", "--vocab-tables", "--vocab-rows"):
        parser.add_argument(name, required=True)
    parser.add_argument("--timeout", type=float, default=TP_TIMEOUT_S)
    parser.add_argument("--threads", type=int, default=0, help="intra-op threads (0: torch's default)")
    args = parser.parse_args(argv)
    if args.threads > 0:  # a CPU rank's share of the cores (TensorParallel._share_cores)
        torch.set_num_threads(args.threads)
    die_with_parent(args.parent)
    # SIGTERM and Ctrl-C go to rank 0, which drains and then stops the workers.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format=f"tp rank {args.rank}: %(message)s")
    channel = Connection(args.control_fd)
    try:
        return _worker(args, channel)
    except (EOFError, OSError):  # rank 0 is gone
        return 0


def _worker(args, channel: Connection) -> int:
    import torch.distributed as dist

    from clef_cuda.kernels import reference
    from clef_cuda.model.config import load_release_config
    from clef_cuda.model.footprint import tensor_bytes
    from clef_cuda.model.shard import Shard, local_config
    from clef_cuda.model.trunk import Trunk
    from clef_cuda.model.vision import VisionTower
    from clef_cuda.model.weights import load_release_weights
    from clef_cuda.verification.guarded_ops import GuardedOps, as_kernel_fault
    from clef_cuda.verification.selfcheck import run_selfcheck

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    news: dict[str, str] = {}  # kernels the guarded library marked failed since the last answer
    base_ops = _worker_ops(args.rank)
    try:
        config = load_release_config(args.release)
        weights = load_release_weights(
            args.release,
            config,
            device,
            dtype,
            progress=False,
            quantize=args.quantize,
            vocab_tables=args.vocab_tables,
            shard=Shard(args.rank, args.size, tuple(int(n) for n in args.vocab_rows.split(":"))),
        )
        ops_ = GuardedOps(base_ops, on_failure=lambda kernel, why: news.__setitem__(kernel, why))
        trunk = Trunk(local_config(config.trunk, args.size), weights.trunk, dtype, ops=ops_)
        tower = VisionTower(config.vision, weights.vision, dtype) if weights.vision is not None else None
    except Exception as error:
        channel.send_bytes(pickle.dumps(("failed", f"loading its shard: {first_line(error, 400)}")))
        return EXIT_WORKER_FAILED
    layers, tables = tensor_bytes(trunk.layers, trunk.final_scale), tensor_bytes(trunk.embed, trunk.lm_head)
    ready = f"{layers / 2**20:.1f} MiB of trunk weights, {tables / 2**20:.1f} MiB of vocabulary rows"
    if tower is not None:
        ready += f", the vision tower ({tensor_bytes(vars(tower)) / 2**20:.1f} MiB)"
    if device.type == "cpu":
        ready += f", {torch.get_num_threads()} intra-op thread(s)"
    channel.send_bytes(pickle.dumps(("ready", ready)))
    store = dist.TCPStore(
        "127.0.0.1", args.port, args.size, is_master=False, timeout=datetime.timedelta(seconds=RENDEZVOUS_TIMEOUT_S)
    )
    lost: list[str] = []
    collectives = _Collectives(
        _join(args.rank, args.size, store, device, args.timeout), device, args.timeout, lost.append
    )
    trunk.collectives = collectives
    trunks = {"fast": trunk, "reference": trunk.with_ops(reference)}
    caches = {}
    c = trunk.config
    with torch.inference_mode():
        while True:
            message = pickle.loads(channel.recv_bytes())
            call = message[0]
            if call == "stop":
                return 0
            _, ops_name, rows, *rest = message
            on, answer = trunks[ops_name], None
            collectives.begin(call, collective_schedule(call, rows, c.hidden_size, c.num_layers, dtype))
            try:
                if call == "forward":
                    batch, name = rest
                    on.forward(_batch_from(batch, device), caches[name])
                elif call == "mlp":
                    index, h = rest
                    on.mlp(index, h.to(device))
                elif call == "vocab_rows":
                    table, ids = rest
                    on.vocab_rows(table, ids.to(device))
                elif call == "copy_slot":
                    name, destination, source = rest
                    on.copy_slot(caches[name], destination, source)
                elif call == "vision" and tower is not None:  # the others have nothing to do
                    (images,) = rest
                    answer = [rows.cpu() for rows in tower(images)]
                elif call == "allocate_cache":
                    num_slots, num_blocks, block_size, name = rest
                    caches.pop(name, None)
                    caches[name] = on.allocate_cache(num_slots, num_blocks, block_size, name)
                elif call == "install":
                    _install(trunk, *rest)
                    trunks["reference"] = trunk.with_ops(reference)
                elif call == "selfcheck":  # with rank 0's kernel decisions installed: what serving will run
                    (block_size,) = rest
                    answer = run_selfcheck(trunk, block_size=block_size)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)  # the call is done on this card (a fault surfaces here)
                status, detail = "ok", answer
            except TensorParallelLost as error:
                log.error("%s", error)
                return 1
            except Exception as error:
                fault = as_kernel_fault(error, trunk.ops)
                if fault is not None:  # the context is gone: say which kernel, then exit
                    log.critical("%s", fault)
                    channel.send_bytes(pickle.dumps(("fault", (fault.kernel, fault.error), dict(news))))
                    return EXIT_WORKER_FAULT
                log.exception("tensor-parallel rank %d: %s failed (the call is failed on every rank)", args.rank, call)
                try:
                    collectives.drain()  # the other ranks must not wait in this call's collectives
                except TensorParallelLost as lost_error:
                    log.error("%s", lost_error)
                    return 1
                status, detail = "failed", f"{type(error).__name__}: {first_line(error)}"
            channel.send_bytes(pickle.dumps((status, detail, dict(news))))
            news.clear()


def _install(trunk, report_json: dict, buckets: list[dict], shapes: dict) -> None:
    from clef_cuda.tuning.autotune import AutotuneReport, Bucket, install

    report = AutotuneReport.from_json(report_json, {}, cached=False)
    install(
        trunk, report, [Bucket(**b) for b in buckets], None, SimpleNamespace(**shapes), on_failure=trunk.ops.on_failure
    )


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1:]))
