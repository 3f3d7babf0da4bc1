#!/usr/bin/env python3
"""Load on a real clef-serve (its own process, on 127.0.0.1), bounded in count and time:

1. decisions/s and p50/p99 latency at concurrency 1, 4 and 16 with random valid requests, next to the
   upstream reference answering the same requests one after another;
2. requests sharing a long (~2k-token) state with new questions each, prefix cache on vs off.

Prints a table last. Targets: throughput at concurrency 4 >= 1.5x concurrency 1; the shared 2k-token
state answered >= 5x faster with the prefix cache than without.

    python benchmarks/server_load.py [--requests 64] [--release tiny|mid]
    python benchmarks/server_load.py --load-only --json-logs --traces   # what JSON logs and traces cost under load
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from random_requests import random_request  # noqa: E402

SERVE_FLAGS: list[str] = []  # added to every clef-serve this run starts (--json-logs, --traces)


class TraceSink:
    """An OTLP/HTTP receiver that takes every export and answers 200 (--traces): the server pays for making and
    sending its spans, not for a collector."""

    def __init__(self) -> None:
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                self.rfile.read(int(self.headers["Content-Length"]))
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@contextlib.contextmanager
def serve(path: Path, *flags: str):
    """clef-serve in a child process (so the load generator never shares its interpreter)."""
    import httpx

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "app",
            "--w",
            str(path),
            "--d",
            "cpu",
            "--host",
            "127.0.0.1",
            "--p",
            str(port),
            "--max-model-len",
            "8192",
            "--log-level",
            "warning",
            *SERVE_FLAGS,
            *flags,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"clef-serve exited: {process.stderr.read()}")
            try:
                if httpx.get(url + "/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        else:
            raise RuntimeError("clef-serve did not become ready")
        yield url
    finally:
        process.terminate()
        process.wait(60)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


async def drive(url: str, requests: list[dict], concurrency: int, budget_s: float) -> tuple[float, list[float], int]:
    """Send `requests` with `concurrency` in flight; returns (elapsed s, latencies s, non-200 count)."""
    import httpx

    queue: asyncio.Queue = asyncio.Queue()
    for r in requests:
        queue.put_nowait(r)
    latencies: list[float] = []
    errors = 0
    deadline = time.perf_counter() + budget_s

    async def worker(client):
        nonlocal errors
        while not queue.empty() and time.perf_counter() < deadline:
            body = queue.get_nowait()
            t0 = time.perf_counter()
            response = await client.post("/v1/systemone", json=body)
            latencies.append(time.perf_counter() - t0)
            errors += response.status_code != 200

    start = time.perf_counter()
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    return time.perf_counter() - start, latencies, errors


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=64, help="requests per concurrency level")
    parser.add_argument(
        "--release",
        choices=["tiny", "mid", "small"],
        default="small",
        help="tiny: the upstream tiny release; mid: tests' second release; small (default): a "
        "~6M-parameter release where per-token work, not per-step overhead, dominates",
    )
    parser.add_argument("--budget", type=float, default=120.0, help="seconds per measurement at most")
    parser.add_argument("--markdown", help="append the table to this file")
    parser.add_argument("--load-only", action="store_true", help="only the concurrency rows (no reference, no cache)")
    parser.add_argument("--json-logs", action="store_true", help="the servers log JSON lines (--log-format json)")
    parser.add_argument("--traces", action="store_true", help="the servers export traces to a local OTLP sink")
    args = parser.parse_args()
    if args.json_logs:
        SERVE_FLAGS.extend(["--log-format", "json"])
    if args.traces:
        SERVE_FLAGS.extend(["--otlp-traces-endpoint", TraceSink().url])

    import torch
    from releases import mid_release, reference_model, tiny_release

    from clef_cuda import Decider

    if args.release == "small":
        import tempfile

        from releases import MID_TEXT, build_release

        text = MID_TEXT | dict(
            hidden_size=256,
            intermediate_size=768,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,
            linear_num_key_heads=4,
            linear_num_value_heads=8,
            linear_key_head_dim=32,
            linear_value_head_dim=32,
            initializer_range=0.05,
        )
        head = {"hidden_size": 256, "width": 128, "routing_layers": 2, "layers": 2, "heads": 4, "feedforward": 256}
        path = build_release(Path(tempfile.mkdtemp()) / "small", text=text, head=head)
    else:
        path = tiny_release() if args.release == "tiny" else mid_release()
    decider = Decider.from_release(path, device="cpu", progress=False)
    rng = random.Random(0)
    requests = [
        random_request(rng, max_choice=8, state_words=(5, 80), null_score_levels=False) for _ in range(args.requests)
    ]
    rows = []

    # 1. Throughput and latency by concurrency.
    reference_rate = None
    if not args.load_only:
        jsm, model, processor = reference_model(path)
        t0 = time.perf_counter()
        done = 0
        for r in requests:
            if time.perf_counter() - t0 > args.budget:
                break
            jsm.systemone(model, processor, r)
            done += 1
        reference_rate = done / (time.perf_counter() - t0)
        rows.append(["reference (sequential, in-process)", "1", f"{reference_rate:.1f}", "-", "-", "-"])
    rates = {}
    for concurrency in (1, 4, 16):
        with serve(path, "--max-num-seqs", "4") as url:
            elapsed, latencies, errors = asyncio.run(drive(url, requests, concurrency, args.budget))
        rates[concurrency] = len(latencies) / elapsed
        rows.append(
            [
                f"clef-serve, {len(latencies)} requests",
                str(concurrency),
                f"{rates[concurrency]:.1f}",
                f"{1e3 * statistics.median(latencies):.0f}",
                f"{1e3 * percentile(latencies, 0.99):.0f}",
                str(errors),
            ]
        )
        print(f"  concurrency {concurrency}: {rates[concurrency]:.1f} decisions/s", flush=True)

    # 2. A shared ~2k-token state, a new question each time: prefix cache on vs off.
    cache_latency = {}
    state = " ".join(f"line {i}: order {1000 + i} shipped late; refund requested" for i in range(40))
    while decider.encode({"model": "m", "state": state, "questions": {"q": {"type": "noul"}}}).state_tokens < 2000:
        state += " more context"
    shared = [
        {
            "model": "clef-flash",
            "state": state,
            "questions": {f"q{i}": {"type": "noul", "instructions": f"Is order {1000 + i} late?"}},
        }
        for i in range(max(8, args.requests // 4))
    ]
    for cached in () if args.load_only else (False, True):
        with serve(path, *([] if cached else ["--disable-prefix-cache"])) as url:
            asyncio.run(drive(url, shared[:1], 1, args.budget))  # the first sight of the state
            elapsed, latencies, errors = asyncio.run(drive(url, shared[1:], 1, args.budget))
        cache_latency[cached] = statistics.median(latencies)
        rows.append(
            [
                f"shared 2k-token state, prefix cache {'on' if cached else 'off'}",
                "1",
                f"{len(latencies) / elapsed:.1f}",
                f"{1e3 * cache_latency[cached]:.0f}",
                f"{1e3 * percentile(latencies, 0.99):.0f}",
                str(errors),
            ]
        )

    header = ["workload", "concurrency", "decisions/s", "p50 ms", "p99 ms", "non-200"]
    switches = (("--load-only", args.load_only), ("--json-logs", args.json_logs), ("--traces", args.traces))
    command = " ".join(["python benchmarks/server_load.py", *(flag for flag, on in switches if on)])
    lines = [
        f"### {time.strftime('%Y-%m-%d')}, CPU {torch.get_num_threads()} threads, {args.release} release, "
        f"server load ({command})",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "|".join("---" for _ in header) + "|",
    ] + ["| " + " | ".join(r) + " |" for r in rows]
    summary = f"Concurrency 4 vs 1: {rates[4] / rates[1]:.2f}x throughput (target >= 1.5x)."
    if cache_latency:
        summary += (
            f" Shared 2k-token state: {cache_latency[False] / cache_latency[True]:.1f}x faster with the prefix cache "
            f"(target >= 5x). clef-serve at concurrency 4 vs the sequential reference: "
            f"{rates[4] / reference_rate:.1f}x."
        )
    lines += ["", summary]
    table = "\n".join(lines)
    if args.markdown:
        with open(args.markdown, "a") as f:
            f.write("\n" + table + "\n")
    print()
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
