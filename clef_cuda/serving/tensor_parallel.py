"""Tensor parallel over the cards of one machine: clef-serve --tensor-parallel-size N starts N - 1 worker
processes (no torchrun), one per card; every rank holds its shard of the trunk (clef_cuda.model.shard) and
runs its part of every trunk call on the same batch; rank 0 (the server process) serves HTTP, schedules,
embeds, runs the vision tower and the joint head.

Two channels between rank 0 and each worker:
  commands   a socket pair (multiprocessing.connection): rank 0 sends what to run before it runs it
             (Trunk.peers: forward, an MLP replay, a cache allocated, a state slot copied, stop). A worker
             waits on it without a timeout (an idle server is not a fault) and exits when it closes (rank 0
             gone).
  tensors    torch.distributed (NCCL on CUDA, gloo on the CPU): each step's embedded rows broadcast from rank
             0, one all-reduce after each mixer and each MLP (Trunk.collectives), under a timeout.
Faults: a worker that exits, or a collective that fails or outlasts the timeout (a hung rank), marks the group
lost: on_lost(reason) is called once (the server turns /ready 503 and exits non-zero), and every later call
raises TensorParallelLost instead of hanging.

What runs on the workers: the fast ops, the reference ops (for shadow runs) and the self-check on their own
shard at start-up (a failure is the worker's exit, with its report). The start-up autotune does not run with
--tensor-parallel-size > 1 (every rank runs the default kernels), LoRA variants are refused.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from clef_cuda.errors import ClefError

log = logging.getLogger("clef_cuda.serving.tensor_parallel")

TP_TIMEOUT_S = 60.0  # a collective (one step's all-reduce) that takes longer: the group is lost
START_TIMEOUT_S = 600.0  # a worker that has not loaded its shard and passed its self-check by then: failed
EXIT_WORKER_FAILED = 3  # a worker that could not start (its report says why)


class TensorParallelLost(ClefError):
    """A rank died, hung or failed a collective: the group cannot run another step."""

    fatal = True  # the engine stops on it (nothing can run again) instead of failing one pack


class _Collectives:
    """Trunk.collectives over a torch.distributed group; any failure marks the group lost."""

    def __init__(self, owner: TensorParallel | None, group) -> None:
        self.owner, self.group = owner, group  # owner: rank 0's TensorParallel (None on a worker)

    def _run(self, op, tensor: torch.Tensor) -> None:
        if self.owner is not None and self.owner.lost is not None:
            raise TensorParallelLost(self.owner.lost)
        staged = tensor if tensor.is_contiguous() else tensor.contiguous()
        try:
            op(staged)
        except Exception as error:  # gloo / NCCL: a peer gone, or the timeout
            reason = f"a tensor-parallel collective failed: {str(error).splitlines()[0] if str(error) else error!r}"
            if self.owner is not None:
                self.owner.mark_lost(reason)
            raise TensorParallelLost(reason) from error
        if staged is not tensor:
            tensor.copy_(staged)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        self._run(lambda t: dist.all_reduce(t, group=self.group), tensor)
        return tensor

    def broadcast(self, tensor: torch.Tensor) -> None:
        import torch.distributed as dist

        self._run(lambda t: dist.broadcast(t, src=0, group=self.group), tensor)


def _batch_message(batch) -> dict:
    """A ChunkBatch as host tensors (the workers rebuild it on their device; no embedding overrides: rank 0
    embeds)."""
    fields = ("input_ids", "positions", "cu_seqlens", "state_slots", "has_initial_state", "slot_mapping")
    message = {name: getattr(batch, name).cpu() for name in fields + ("block_tables", "context_lens")}
    message["q_lens"], message["context_lengths"] = batch.q_lens, batch.context_lengths
    return message


def _batch_from(message: dict, device: torch.device):
    from clef_cuda.model.trunk import ChunkBatch

    tensors = {k: v.to(device) for k, v in message.items() if isinstance(v, torch.Tensor)}
    return ChunkBatch(**tensors, q_lens=message["q_lens"], context_lengths=message["context_lengths"])


class TensorParallel:
    """Rank 0's side: the workers, the command channels, the collectives (Trunk.peers implements run())."""

    def __init__(self, size: int, on_lost=None, timeout: float = TP_TIMEOUT_S) -> None:
        self.size, self.timeout, self.on_lost = size, timeout, on_lost
        self.lost: str | None = None
        self.workers: list[subprocess.Popen] = []
        self.channels: list[Connection] = []
        self._lock = threading.Lock()
        self._stopping = False
        self.group = None  # the collectives' process group

    # ---- start-up ------------------------------------------------------------------------------------
    def start(self, release: str | Path, device: torch.device, dtype: torch.dtype, quantize: str) -> None:
        """Start the workers (each loads its shard, runs its self-check) and join the group as rank 0."""
        port = _free_port()
        for rank in range(1, self.size):
            ours, theirs = socket.socketpair()
            worker_device = f"cuda:{(device.index or 0) + rank}" if device.type == "cuda" else "cpu"
            command = [
                sys.executable,
                "-m",
                "clef_cuda.serving.tensor_parallel",
                "--rank",
                str(rank),
                "--size",
                str(self.size),
                "--port",
                str(port),
                "--control-fd",
                str(theirs.fileno()),
                "--release",
                str(release),
                "--device",
                worker_device,
                "--dtype",
                str(dtype).removeprefix("torch."),
                "--quantize",
                quantize,
                "--timeout",
                str(self.timeout),
            ]
            self.workers.append(subprocess.Popen(command, pass_fds=(theirs.fileno(),)))
            theirs.close()
            self.channels.append(Connection(os.dup(ours.fileno())))
            ours.close()
        self.group = _join(0, self.size, port, device, self.timeout)
        for rank, channel in enumerate(self.channels, 1):  # each worker's report: loaded and self-checked
            if not channel.poll(START_TIMEOUT_S):
                self.stop()
                raise TensorParallelLost(f"tensor-parallel rank {rank} did not start within {START_TIMEOUT_S:.0f} s")
            try:
                status, detail = pickle.loads(channel.recv_bytes())
            except (EOFError, OSError):
                status, detail = "failed", f"exited with code {self.workers[rank - 1].wait()}"
            if status != "ready":
                self.stop()
                raise TensorParallelLost(f"tensor-parallel rank {rank} failed to start: {detail}")
            log.info("tensor-parallel rank %d ready: %s", rank, detail)
        threading.Thread(target=self._watch, name="clef-tp-watch", daemon=True).start()

    def attach(self, trunk) -> None:
        """Make `trunk` (rank 0's shard) tell the workers each call and sum over the group."""
        trunk.peers = self
        trunk.collectives = _Collectives(self, self.group)

    # ---- faults --------------------------------------------------------------------------------------
    def mark_lost(self, reason: str) -> None:
        with self._lock:
            if self.lost is not None or self._stopping:
                return
            self.lost = reason
        log.error("%s", reason)
        if self.on_lost is not None:
            self.on_lost(reason)

    def _watch(self) -> None:
        while not self._stopping:
            for rank, worker in enumerate(self.workers, 1):
                code = worker.poll()
                if code is not None and not self._stopping:
                    self.mark_lost(f"tensor-parallel rank {rank} exited with code {code}")
                    return
            time.sleep(0.2)

    # ---- Trunk.peers ---------------------------------------------------------------------------------
    def run(self, trunk, call: str, *args) -> None:
        """Tell every worker to make `call` with `args` on its shard (the same collectives follow)."""
        if self.lost is not None:
            raise TensorParallelLost(self.lost)
        if call == "forward":
            batch, cache, lora, probe = args
            if lora:
                raise TensorParallelLost("LoRA variants are not sharded across tensor-parallel ranks")
            message = (call, trunk.ops_name, _batch_message(batch), cache.name)
        elif call == "mlp":
            index, h = args
            message = (call, trunk.ops_name, index, h.cpu())
        elif call == "copy_slot":
            cache, destination, source = args
            message = (call, trunk.ops_name, cache.name, destination, source)
        else:  # allocate_cache
            message = (call, trunk.ops_name, *args)
        payload = pickle.dumps(message)  # plain pickle: tensors by value (not torch's shared-memory handles)
        try:
            for channel in self.channels:
                channel.send_bytes(payload)
        except (OSError, EOFError) as error:
            self.mark_lost(f"a tensor-parallel worker stopped listening ({error})")
            raise TensorParallelLost(self.lost) from error

    def stop(self, timeout: float = 30.0) -> None:
        """Tell every worker to exit, wait for them (killing any that do not), leave the group."""
        self._stopping = True
        for channel in self.channels:
            try:
                channel.send_bytes(pickle.dumps(("stop",)))
                channel.close()
            except (OSError, EOFError):
                pass
        deadline = time.monotonic() + timeout
        for worker in self.workers:
            try:
                worker.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait()
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def _join(rank: int, size: int, port: int, device: torch.device, timeout: float):
    """Join the ranks (NCCL on CUDA, gloo on the CPU) as `rank`: the rendezvous may take START_TIMEOUT_S (a
    worker joins before it loads its shard); the group the trunk's collectives run on, `timeout`."""
    import torch.distributed as dist

    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=size,
        timeout=datetime.timedelta(seconds=START_TIMEOUT_S),
    )
    return dist.new_group(list(range(size)), timeout=datetime.timedelta(seconds=timeout))


def _nbytes(weight) -> int:
    parts = (weight.qweight, weight.scale) if hasattr(weight, "qweight") else (weight,)
    return sum(t.numel() * t.element_size() for t in parts)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- the worker process ----------------------------------------------------------------------------------
def worker_main(argv: list[str]) -> int:
    import signal

    from clef_cuda import reference
    from clef_cuda.model.config import load_release_config
    from clef_cuda.model.shard import Shard, local_config
    from clef_cuda.model.trunk import Trunk
    from clef_cuda.model.weights import load_release_weights
    from clef_cuda.serving.selfcheck import run_selfcheck

    parser = argparse.ArgumentParser(prog="clef_cuda.serving.tensor_parallel")
    for name in ("--rank", "--size", "--port", "--control-fd"):
        parser.add_argument(name, type=int, required=True)
    for name in ("--release", "--device", "--dtype", "--quantize"):
        parser.add_argument(name, required=True)
    parser.add_argument("--timeout", type=float, default=TP_TIMEOUT_S)
    args = parser.parse_args(argv)
    # SIGTERM and Ctrl-C go to rank 0, which drains and then stops the workers.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format=f"tp rank {args.rank}: %(message)s")
    channel = Connection(args.control_fd)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    group = _join(args.rank, args.size, args.port, device, args.timeout)
    try:
        config = load_release_config(args.release)
        shard = Shard(args.rank, args.size)
        weights = load_release_weights(
            args.release, config, device, dtype, progress=False, quantize=args.quantize, shard=shard
        )
        trunk = Trunk(local_config(config.trunk, args.size), weights.trunk, dtype)
    except Exception as error:
        channel.send_bytes(pickle.dumps(("failed", f"loading its shard: {error}")))
        return EXIT_WORKER_FAILED
    with torch.inference_mode():
        report = run_selfcheck(trunk)
    if not report.passed:
        channel.send_bytes(pickle.dumps(("failed", f"its self-check failed:\n{report.table()}")))
        return EXIT_WORKER_FAILED
    trunk.collectives = _Collectives(None, group)
    trunks = {"fast": trunk, "reference": trunk.with_ops(reference)}
    shard_bytes = sum(_nbytes(t) for t in weights.trunk.values() if t is not None)
    ready = f"{shard_bytes / 2**20:.1f} MiB of trunk weights, self-check {report.summary()}"
    channel.send_bytes(pickle.dumps(("ready", ready)))
    caches = {}
    with torch.inference_mode():
        while True:
            try:
                message = pickle.loads(channel.recv_bytes())
            except (EOFError, OSError):  # rank 0 is gone
                return 0
            call, ops_name = message[0], message[1] if len(message) > 1 else None
            try:
                if call == "stop":
                    return 0
                on = trunks[ops_name]
                if call == "forward":
                    _, _, batch, name = message
                    on.forward(_batch_from(batch, device), caches[name])
                elif call == "mlp":
                    _, _, index, h = message
                    on.mlp(index, h.to(device))
                elif call == "copy_slot":
                    _, _, name, destination, source = message
                    on.copy_slot(caches[name], destination, source)
                elif call == "allocate_cache":
                    _, _, num_slots, num_blocks, block_size, name = message
                    caches.pop(name, None)
                    caches[name] = on.allocate_cache(num_slots, num_blocks, block_size, name)
            except TensorParallelLost as error:
                log.error("%s", error)
                return 1
            except Exception:  # rank 0 sees the same step fail (its collective times out): make it prompt
                log.exception("tensor-parallel rank %d: %s failed", args.rank, call)
                return 1


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1:]))
