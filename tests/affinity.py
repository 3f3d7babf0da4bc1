"""Replicas behind a real load balancer on loopback: two clef-serve processes (the embedded clef-tiny) and
Debian's HAProxy in front, either hashing on X-Clef-Prefix-Key (consistent hashing with bounded load) or
round-robin; a workload where states repeat, sent with the key each client computes itself
(clef_cuda.request.routing.prefix_key). Used by tests/test_routing.py and benchmarks/affinity.py."""

from __future__ import annotations

import contextlib
import random
import shutil
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
from live import clef_serve_process, free_port, wait_until

from clef_cuda.request.routing import prefix_key

HAPROXY_CONFIG = """global
    maxconn 512
defaults
    mode http
    timeout connect 5s
    timeout client 120s
    timeout server 120s
frontend clef
    bind 127.0.0.1:{port}
    default_backend replicas
backend replicas
{balance}
    http-response set-header X-Served-By %s
    server replica-1 127.0.0.1:{first}
    server replica-2 127.0.0.1:{second}
"""
BALANCE = {
    # Consistent hashing on the header, with bounded load: a hot key spills over once its replica carries
    # 1.5x the average (HAProxy's hash-balance-factor), instead of pinning all of it to one GPU.
    "hash": "    balance hdr(x-clef-prefix-key)\n    hash-type consistent\n    hash-balance-factor 150",
    "round-robin": "    balance roundrobin",
}
WORDS = ["INFO", "api:", "request", "served", "ERROR", "db:", "connection", "refused", "WARN", "cache:", "latency"]


def haproxy_binary() -> str:
    found = shutil.which("haproxy") or ("/usr/sbin/haproxy" if Path("/usr/sbin/haproxy").exists() else None)
    if found is None:
        raise RuntimeError("haproxy is not installed (Debian: apt-get install haproxy; .ci/run installs it)")
    return found


@contextlib.contextmanager
def replicas(count: int = 2):
    """`count` clef-serve processes on the embedded clef-tiny; yields their base URLs."""
    with contextlib.ExitStack() as stack:
        urls = [
            stack.enter_context(clef_serve_process("--d", "cpu", "--kv-fraction", "0.05", "--log-level", "warning"))[0]
            for _ in range(count)
        ]
        yield urls


@contextlib.contextmanager
def balancer(urls: list[str], mode: str):
    """HAProxy on a free port in front of two replicas; yields its URL."""
    port = free_port()
    ports = [url.rsplit(":", 1)[1] for url in urls]
    config = HAPROXY_CONFIG.format(port=port, balance=BALANCE[mode], first=ports[0], second=ports[1])
    with tempfile.TemporaryDirectory(prefix="clef-haproxy-") as work:
        path = Path(work) / "haproxy.cfg"
        path.write_text(config)
        check = subprocess.run([haproxy_binary(), "-c", "-f", str(path)], capture_output=True, text=True)
        if check.returncode != 0:
            raise RuntimeError(f"haproxy rejected its configuration: {check.stdout}{check.stderr}")
        process = subprocess.Popen(
            [haproxy_binary(), "-db", "-f", str(path)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        url = f"http://127.0.0.1:{port}"
        try:

            def healthy() -> bool:
                with contextlib.suppress(httpx.HTTPError):
                    return httpx.get(url + "/health", timeout=1).status_code == 200
                return False

            wait_until(healthy, "haproxy to answer /health")
            yield url
        finally:
            process.terminate()
            process.wait(10)


def workload(states: int, repeats: int, seed: int = 0) -> list[dict]:
    """`states` log states long enough to be snapshotted, each asked `repeats` times with varied
    questions, shuffled."""
    rng = random.Random(seed)
    bodies = []
    for s in range(states):
        lines = [
            f"12:{i:02d}:{rng.randrange(60):02d} " + " ".join(rng.choice(WORDS) for _ in range(8)) for i in range(40)
        ]
        state = f"service {s}\n" + "\n".join(lines)
        for r in range(repeats):
            question = {"type": "noul", "instructions": f"Is the last log line an ERROR? ({r})"}
            bodies.append({"model": "clef-tiny", "state": state, "questions": {"last_error": question}})
    rng.shuffle(bodies)
    return bodies


@dataclass
class Run:
    mode: str
    requests: int
    hits: int
    seconds: float
    served_by: dict[str, str]  # prefix key -> the replicas that served it ("a,b" when it moved)
    keys_match: bool  # every response's X-Clef-Prefix-Key equals the one the client computed

    @property
    def hit_rate(self) -> float:
        return self.hits / self.requests

    @property
    def per_second(self) -> float:
        return self.requests / self.seconds


def run(url: str, mode: str, bodies: list[dict], concurrency: int = 4) -> Run:
    served: dict[str, set[str]] = {}
    hits, keys_match = 0, True

    def send(client: httpx.Client, body: dict):
        key = prefix_key(body["model"], body["state"])
        response = client.post("/v1/systemone", json=body, headers={"X-Clef-Prefix-Key": key})
        response.raise_for_status()
        return key, response

    started = time.monotonic()
    with httpx.Client(base_url=url, timeout=120) as client, ThreadPoolExecutor(concurrency) as pool:
        for key, response in pool.map(lambda b: send(client, b), bodies):
            served.setdefault(key, set()).add(response.headers["x-served-by"])
            hits += response.headers["x-clef-prefix-cache"] == "hit"
            keys_match &= response.headers["x-clef-prefix-key"] == key
    seconds = time.monotonic() - started
    return Run(mode, len(bodies), hits, seconds, {k: ",".join(sorted(v)) for k, v in served.items()}, keys_match)
