#!/usr/bin/env python3
"""`clef-serve batch` against the HTTP server driven by a concurrent client, on the same file: rows/s and
prefix-cache hit rate of each, on clef-tiny and a mid test release (CPU). The file: S states (tickets of
~300 words) x 4 question sets, shuffled, as a backlog scored with several questionnaires comes. The HTTP
client sends rows in file order at each concurrency and the best one is kept; each side its own server
process, started before the clock (only the scoring is timed). Two caches, the same flags for both paths:
"card", --max-model-len 4096 (the CPU plan then keeps 2,048 KV blocks, 32,768 tokens: about what clef-flash
has on a 16 GB V100, fewer tokens than the file's states), and "host", the CPU defaults (131,072 tokens,
enough for every state of the file: both paths then hit on every repeat and only the engine's speed counts).
Then the runner's memory over a long file (a server that answers at once, so the runner alone is measured).
Tables last.

    python benchmarks/batch_rows.py [--rows 500] [--memory-rows 100000] [--models tiny,mid] [--caches card,host]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

WORDS = "checkout fails login slow error db web timeout refund payment page crash invoice retry".split()
QUESTION_SETS = [
    {"urgent": {"type": "noul", "instructions": "Is it urgent?"}},
    {"team": {"type": "choice", "instructions": "Which team?", "criteria": {"web": None, "db": None, "pay": None}}},
    {"severity": {"type": "score", "instructions": "How bad?", "criteria": ["low", "medium", "high"]}},
    {
        "refund": {"type": "noul", "instructions": "Refund asked?"},
        "area": {"type": "choice", "criteria": {"login": None, "checkout": None, "other": None}},
    },
]


def write_rows(path: Path, rows: int, model: str, seed: int = 0) -> None:
    rng = random.Random(seed)
    states = rows // len(QUESTION_SETS)
    pairs = [(s, q) for s in range(states) for q in range(len(QUESTION_SETS))][:rows]
    rng.shuffle(pairs)
    with open(path, "w") as f:
        for number, (state, q) in enumerate(pairs):
            words = random.Random(state * 7919 + seed).choices(WORDS, k=300)
            body = {
                "model": model,
                "state": f"ticket {seed}-{state}: " + " ".join(words),
                "questions": QUESTION_SETS[q],
            }
            f.write(json.dumps({"custom_id": f"row-{number}", "body": body}) + "\n")


CACHES = {"card": ["--max-model-len", "4096"], "host": []}


def serve_args(release: Path | None, cache: str) -> list[str]:
    weights = ["--w", str(release)] if release else []
    return [*weights, "--d", "cpu", "--kv-fraction", "0.3", "--log-level", "warning", *CACHES[cache]]


def run_batch(release: Path | None, cache: str, source: Path, sink: Path) -> tuple[float, float, str]:
    """(rows/s, hit rate, summary) from the runner's own summary (scoring time, start-up excluded)."""
    sink.unlink(missing_ok=True)
    command = [sys.executable, "-m", "app", "batch", str(source), str(sink), *serve_args(release, cache)]
    command.append("--no-progress")
    done = subprocess.run(command, capture_output=True, text=True, timeout=3600)
    assert done.returncode == 0, done.stderr[-2000:]
    line = next(x for x in done.stderr.splitlines() if re.match(r"\d+ rows: ", x))
    rate = float(re.search(r"([\d.]+) rows/s", line).group(1))
    ok = int(re.search(r"(\d+) ok", line).group(1))
    hits = int(re.search(r"(\d+) prefix-cache hits", line).group(1))
    return rate, hits / ok, line


async def _drive(url: str, bodies: list[dict], concurrency: int) -> tuple[float, int]:
    gate = asyncio.Semaphore(concurrency)
    hits = 0

    async def one(client, body):
        nonlocal hits
        async with gate:
            response = await client.post(f"{url}/v1/systemone", json=body)
            assert response.status_code == 200, response.text
            hits += response.json()["x_cached_tokens"] > 0

    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=concurrency)) as client:
        started = time.perf_counter()
        await asyncio.gather(*(one(client, body) for body in bodies))
        return time.perf_counter() - started, hits


def run_http(
    release: Path | None, cache: str, source: Path, concurrencies: list[int]
) -> list[tuple[int, float, float]]:
    """(concurrency, rows/s, hit rate) for each, each against a fresh server (no cache warm from the last)."""
    from live import clef_serve_process

    bodies = [json.loads(line)["body"] for line in source.read_text().splitlines()]
    results = []
    for concurrency in concurrencies:
        with clef_serve_process(*serve_args(release, cache), "--max-queue", "1024") as (url, _, _):
            httpx.post(f"{url}/v1/systemone", json=bodies[0] | {"state": "warm"}, timeout=600)  # not a row's state
            seconds, hits = asyncio.run(_drive(url, bodies, concurrency))
        results.append((concurrency, len(bodies) / seconds, hits / len(bodies)))
    return results


def runner_memory(rows: int, read_ahead: int = 1024) -> list[tuple[int, float]]:
    """(rows written, the process's RSS in MiB) through the runner against an app that answers at once."""
    import psutil
    from test_batch import stub_app

    from app import batch

    process = psutil.Process()
    samples: list[tuple[int, float]] = []
    with tempfile.TemporaryDirectory() as scratch:
        source, sink = Path(scratch) / "in.jsonl", Path(scratch) / "out.jsonl"
        with open(source, "w") as f:
            for n in range(rows):
                f.write(json.dumps({"line": n + 1, "state": f"ticket {n}: " + "word " * 60}) + "\n")
        stop = threading.Event()

        def sample():
            while not stop.wait(0.5):
                written = sink.stat().st_size and sum(1 for _ in open(sink, "rb")) if sink.exists() else 0
                samples.append((written, process.memory_info().rss / 2**20))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        asyncio.run(batch.run(stub_app(), source, sink, 16, read_ahead, progress=False))
        stop.set()
        sampler.join()
        samples.append((rows, process.memory_info().rss / 2**20))
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=500)
    parser.add_argument("--memory-rows", type=int, default=100_000)
    parser.add_argument("--models", default="tiny,mid")
    parser.add_argument("--caches", default="card,host")
    parser.add_argument("--concurrency", default="4,8,16,32", help="the HTTP client's concurrencies tried")
    args = parser.parse_args()
    os.environ.setdefault("CLEF_FINETUNE_JSM", "vendored")
    from releases import mid_release

    concurrencies = [int(c) for c in args.concurrency.split(",")]
    table = []
    with tempfile.TemporaryDirectory() as scratch:
        for name in filter(None, args.models.split(",")):
            release, model = (None, "clef-tiny") if name == "tiny" else (mid_release(), "clef-flash")
            source = Path(scratch) / f"{name}.jsonl"
            write_rows(source, args.rows, model)
            for cache in args.caches.split(","):
                rate, hit_rate, line = run_batch(release, cache, source, Path(scratch) / f"{name}.out.jsonl")
                print(f"{name}, {cache} cache: batch: {line}", flush=True)
                http = run_http(release, cache, source, concurrencies)
                for concurrency, http_rate, http_hits in http:
                    print(f"{name}, {cache} cache: HTTP at {concurrency}: {http_rate:.2f} rows/s, hits {http_hits:.0%}")
                best = max(http, key=lambda r: r[1])
                table.append((name, cache, rate, hit_rate, best))
    memory = runner_memory(args.memory_rows) if args.memory_rows else []

    cpu = next((x.split(":", 1)[1].strip() for x in open("/proc/cpuinfo") if x.startswith("model name")), "?")
    print(
        f"\nbatch vs HTTP: {args.rows} rows ({args.rows // len(QUESTION_SETS)} states x {len(QUESTION_SETS)}"
        f" question sets, shuffled), {cpu}, {os.cpu_count()} cores"
    )
    print(
        f"{'model':<6} {'cache':<5} {'batch rows/s':>12} {'hits':>5} {'HTTP best rows/s':>16} {'at':>3} {'hits':>5}"
        f" {'ratio':>6}"
    )
    for name, cache, rate, hit_rate, (concurrency, http_rate, http_hits) in table:
        print(
            f"{name:<6} {cache:<5} {rate:>12.2f} {hit_rate:>5.0%} {http_rate:>16.2f} {concurrency:>3}"
            f" {http_hits:>5.0%} {rate / http_rate:>5.2f}x"
        )
    if memory:
        print(f"\nthe runner's memory over {args.memory_rows} rows (read-ahead 1,024; a server answering at once)")
        print(f"{'rows written':>12} {'RSS MiB':>8}")
        marks = [memory[int(i * (len(memory) - 1) / 5)] for i in range(6)]
        for written, rss in marks:
            print(f"{written:>12} {rss:>8.1f}")
        print(f"growth from the first sample to the last: {memory[-1][1] - memory[0][1]:+.1f} MiB")


if __name__ == "__main__":
    main()
