"""`clef-serve batch INPUT.jsonl OUTPUT.jsonl`: score a file of System One requests offline, as vLLM's
`run-batch` does for chat requests, with the server's own pipeline and answers.

Input: one request per line, either a System One body or the OpenAI / vLLM batch form
`{"custom_id": "...", "method": "POST", "url": "/v1/systemone", "body": {...}}` (`url` may also be the Workers
AI route, `/client/v4/accounts/<id>/ai/run/@cf/cloudflare/<model>`); blank lines are skipped.
Output: one line per request, in input order:
`{"id", "custom_id", "line", "status": "ok" | "refused" | "failed", "response": {"status_code", "request_id",
"body"}, "error": null | {"code", "message"}}`; `body` is exactly what the server would have answered, the
contract's error body for a refused row.

How it runs:
- Each row goes through the FastAPI app in-process (the same validation, limits, errors and answers as the
  server: a row the server would refuse is recorded with that refusal, and the run goes on). No socket.
- The engine is kept fed: up to `max_in_flight` rows in flight (continuous batching does the rest), read
  `read_ahead` rows ahead of the last one written. Rows with the same state (and model and images) are
  scheduled together: the first goes alone, the rest once it is done, so they start from its prefix-cache
  snapshot instead of prefilling the state again; other states fill the engine meanwhile.
- Memory is bounded by `read_ahead` rows (and READ_AHEAD_BYTES of them), whatever the file's length: the
  input is read as it is needed and each answer written (and flushed) as soon as every row before it is.
- Resumable: OUTPUT is appended to. A rerun checks that OUTPUT's rows are INPUT's rows in order (exit 2 if
  not: another file), drops a torn last line, and starts after the last row written. SIGINT (Ctrl-C) stops
  asking: the rows in flight finish, what can be written in order is, and the rows answered past a row not
  yet asked go to OUTPUT.held, which the rerun writes in their place (nothing answered is asked twice); a
  second SIGINT stops at once (the rows in flight, and any not yet written, are asked again by the rerun).
- A 503 (a step out of memory, a busy rank) is retried after its Retry-After, three times; a row that still
  fails, or gets any other 5xx, is recorded "failed". Exit 0 when every row was answered or refused, 1 when
  some failed (or the model never became ready), 130 when interrupted.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import os
import re
import signal
import sys
import time
from collections import OrderedDict, deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

import httpx

DECISION_URL = "/v1/systemone"
_WORKERS_AI_URL = re.compile(r"/client/v4/accounts/[^/]+/ai/run/\S+")
WRAPPER_FIELDS = frozenset({"custom_id", "method", "url", "body"})
RETRIES_ON_503 = 3
# Rows read ahead are bounded in bytes too: a row may carry megabytes of images (the server takes 32 MiB).
READ_AHEAD_BYTES = 256 * 2**20
EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 1, 2, 130


class BatchFileError(ValueError):
    """INPUT or OUTPUT cannot be used (the CLI prints it as one line, exit 2)."""


@dataclasses.dataclass
class Row:
    line: int  # 1-based line number in INPUT
    custom_id: str | None
    url: str
    body: bytes  # what is POSTed: the line itself, or its "body" re-encoded
    group: bytes | None  # rows with one state, model and images share it; None: a group of its own
    refusal: tuple[int, dict[str, Any]] | None = None  # a wrapper this command refuses itself (a bad url)
    attempts: int = 0


def _refusal(status: int, message: str) -> tuple[int, dict[str, Any]]:
    return status, {"detail": {"error_type": "invalid_request_error", "message": message}}


def _group_of(body: Any) -> bytes | None:
    """What decides a prefix-cache hit between two rows: the model, the images and the state (the record puts
    them before the questions)."""
    if not isinstance(body, dict) or "state" not in body:
        return None
    key = json.dumps([body.get("model"), body.get("images"), body.get("state")], sort_keys=True, default=str)
    return hashlib.blake2b(key.encode(), digest_size=16).digest()


def parse_row(number: int, text: str) -> Row | None:
    """One input line as a Row; None for a blank one. Never raises: a line that is not JSON is sent as it is
    (the server's 422 is recorded for it), a wrapper with a url other than a decision route is refused here."""
    if not text.strip():
        return None
    raw = text.rstrip("\r\n").encode("utf-8", "surrogateescape")  # the bytes as read, UTF-8 or not
    try:
        parsed = json.loads(text)
    except ValueError:
        return Row(number, None, DECISION_URL, raw, None)
    if not (isinstance(parsed, dict) and "body" in parsed and set(parsed) <= WRAPPER_FIELDS):
        return Row(number, None, DECISION_URL, raw, _group_of(parsed))
    custom_id = parsed.get("custom_id")
    url = parsed.get("url", DECISION_URL)
    row = Row(number, custom_id if isinstance(custom_id, str) else None, DECISION_URL, b"", None)
    if custom_id is not None and not isinstance(custom_id, str):
        row.refusal = _refusal(400, f"custom_id must be a string, got {type(custom_id).__name__}")
    elif parsed.get("method", "POST") != "POST":
        row.refusal = _refusal(400, f"method {str(parsed.get('method'))[:20]!r}: only POST is served")
    elif not isinstance(url, str) or not (url == DECISION_URL or _WORKERS_AI_URL.fullmatch(url)):
        row.refusal = _refusal(
            400, f"url {str(url)[:80]!r}: a batch row goes to {DECISION_URL} or the Workers AI route"
        )
    else:
        row.url, row.body, row.group = url, json.dumps(parsed["body"]).encode(), _group_of(parsed["body"])
    return row


def read_rows(source: TextIO, start_line: int = 0) -> Iterator[Row]:
    """INPUT's rows after line `start_line`, one at a time."""
    for number, text in enumerate(source, start=1):
        if number > start_line:
            row = parse_row(number, text)
            if row is not None:
                yield row


def record(row: Row, status: int, body: Any, request_id: str | None) -> dict[str, Any]:
    """The output line of a row the server (or this command) answered with `status` and `body`."""
    outcome = "ok" if status < 400 else "refused" if status < 500 else "failed"
    error = None
    if outcome != "ok":
        detail = body.get("detail") if isinstance(body, dict) else None
        if isinstance(detail, dict):
            error = {"code": detail.get("error_type", str(status)), "message": detail.get("message", "")}
        elif isinstance(detail, list):  # FastAPI's 422 list
            error = {"code": "validation_error", "message": "; ".join(str(item.get("msg")) for item in detail)}
        elif isinstance(body, dict) and body.get("errors"):  # the Workers AI envelope
            first = body["errors"][0]
            error = {"code": str(first.get("code")), "message": first.get("message", "")}
        else:
            error = {"code": str(status), "message": str(body)[:500]}
    return {
        "id": f"clef-batch-{row.line}",
        "custom_id": row.custom_id,
        "line": row.line,
        "status": outcome,
        "response": {"status_code": status, "request_id": request_id, "body": body},
        "error": error,
    }


def resume_point(input_path: Path, output_path: Path) -> tuple[int, int]:
    """(the last input line OUTPUT has answered, how many rows it holds), after checking that OUTPUT's rows
    are INPUT's in order. A torn last line (a run killed mid-write) is cut off. BatchFileError when OUTPUT is
    another file's."""
    if not output_path.exists():
        return 0, 0
    last_line, rows, keep = 0, 0, 0
    with open(input_path, encoding="utf-8", errors="replace") as source, open(output_path, "rb") as written:
        expected = read_rows(source)
        for raw in written:
            if not raw.endswith(b"\n"):
                break  # torn: cut below
            try:
                done = json.loads(raw)
                line, custom_id = done["line"], done.get("custom_id")
            except (ValueError, KeyError, TypeError) as error:
                raise BatchFileError(
                    f"OUTPUT {output_path}: row {rows + 1} is not a batch record ({error}): choose another OUTPUT"
                ) from None
            want = next(expected, None)
            if want is None or (want.line, want.custom_id) != (line, custom_id):
                what = "nothing" if want is None else f"line {want.line} ({want.custom_id!r})"
                raise BatchFileError(
                    f"OUTPUT {output_path} does not continue INPUT {input_path}: its row {rows + 1} answers line "
                    f"{line} ({custom_id!r}), INPUT's row {rows + 1} is {what}; choose another OUTPUT"
                )
            last_line, rows, keep = line, rows + 1, keep + len(raw)
    if keep != output_path.stat().st_size:
        with open(output_path, "r+b") as written:
            written.truncate(keep)
    return last_line, rows


def count_rows(input_path: Path, after_line: int) -> int:
    """Rows left in INPUT after `after_line` (for the progress bar's ETA): one pass, no line kept."""
    with open(input_path, "rb") as source:
        return sum(1 for number, text in enumerate(source, start=1) if number > after_line and text.strip())


@dataclasses.dataclass
class Summary:
    ok: int = 0
    refused: int = 0
    failed: int = 0
    resumed: int = 0  # rows an earlier run had written
    restored: int = 0  # of the rows, those an interrupted run had answered and held (OUTPUT.held)
    held: int = 0  # interrupted: rows answered past a row not yet asked, left in OUTPUT.held for the rerun
    input_tokens: int = 0
    cached_tokens: int = 0
    prefix_hits: int = 0  # answered rows that started from a prefix-cache snapshot
    seconds: float = 0.0  # scoring, from the model ready to the last row written
    loading_seconds: float = 0.0  # the start-up before it: self-check, autotune, warm-up
    interrupted: bool = False

    @property
    def rows(self) -> int:
        """Rows this run asked and wrote."""
        return self.ok + self.refused + self.failed

    def count(self, line: dict[str, Any], restored: bool = False) -> None:
        self.restored += restored
        setattr(self, line["status"], getattr(self, line["status"]) + 1)
        body = line["response"]["body"]
        result = body.get("result", body) if isinstance(body, dict) and line["status"] == "ok" else None
        if isinstance(result, dict) and isinstance(result.get("usage"), dict):
            self.input_tokens += result["usage"].get("input_tokens", 0)
            cached = result.get("x_cached_tokens", 0)
            self.cached_tokens += cached
            self.prefix_hits += cached > 0

    def describe(self) -> str:
        rate = (self.rows - self.restored) / self.seconds if self.seconds else 0.0
        hits = f"{self.prefix_hits} prefix-cache hits ({self.prefix_hits / max(self.ok, 1):.0%} of answered rows)"
        held = f" ({self.restored} answered by an interrupted run and held)" if self.restored else ""
        resumed = f"; {self.resumed} written by an earlier run" if self.resumed else ""
        return (
            f"{self.rows} rows: {self.ok} ok, {self.refused} refused, {self.failed} failed{held}{resumed}; "
            f"{self.input_tokens} input tokens, {self.cached_tokens} from the prefix cache, {hits}; "
            f"{self.seconds:.1f} s, {rate:.2f} rows/s (after {self.loading_seconds:.1f} s of start-up)"
            + (f"; interrupted: {self.held} more answered and held, rerun to resume" if self.interrupted else "")
        )


class Scheduler:
    """Which buffered row goes next. A row whose group has its first row in flight (the leader, not yet done)
    waits; a row whose group's leader is done goes first, the most recently done group first (its prefix is
    cached now, and may be evicted later); else the oldest. Holds at most the rows read ahead; each pick costs
    O(rows in flight)."""

    def __init__(self):
        self.waiting: OrderedDict[bytes | int, deque[Row]] = OrderedDict()  # group -> its rows, oldest group first
        self.leading: set[bytes] = set()  # groups with their first row in flight
        self.warm: OrderedDict[bytes, None] = OrderedDict()  # groups whose leader is done (recent last)
        self.hot: deque[bytes] = deque()  # warm groups that had rows waiting when last seen (stale ones skipped)
        self.size = 0

    def add(self, row: Row) -> None:
        key = row.group if row.group is not None else -row.line  # an int: a group of its own
        self.waiting.setdefault(key, deque()).append(row)
        self.size += 1
        if key in self.warm:
            self.hot.append(key)

    def next(self) -> Row | None:
        while self.hot:
            if self.hot[-1] in self.waiting:
                return self._take(self.hot[-1])
            self.hot.pop()
        for key in self.waiting:
            if key not in self.leading:
                if isinstance(key, bytes):
                    self.leading.add(key)
                return self._take(key)
        return None

    def done(self, row: Row) -> None:
        if row.group is not None and row.group in self.leading:
            self.leading.discard(row.group)
            self.warm[row.group] = None
            while len(self.warm) > 4096:  # what the cache can still hold is far less; this only bounds memory
                self.warm.popitem(last=False)
            if row.group in self.waiting:
                self.hot.append(row.group)

    def _take(self, key) -> Row:
        rows = self.waiting[key]
        row = rows.popleft()
        if not rows:
            del self.waiting[key]
        self.size -= 1
        return row


async def _post(client: httpx.AsyncClient, row: Row) -> dict[str, Any]:
    """The row's output line; never raises (a fault of ours is the row's 500, and the run goes on)."""
    if row.refusal is not None:
        return record(row, row.refusal[0], row.refusal[1], None)
    try:
        return await _post_until_answered(client, row)
    except Exception as error:
        message = f"the batch runner failed: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        return record(row, 500, {"detail": {"error_type": "internal_error", "message": message}}, None)


async def _post_until_answered(client: httpx.AsyncClient, row: Row) -> dict[str, Any]:
    while True:
        row.attempts += 1
        response = await client.post(row.url, content=row.body, headers={"Content-Type": "application/json"})
        if response.status_code == 503 and row.attempts <= RETRIES_ON_503:
            await asyncio.sleep(min(float(response.headers.get("retry-after", "1") or 1), 30.0))
            continue
        try:
            body = response.json()
        except ValueError:
            body = response.text
        return record(row, response.status_code, body, response.headers.get("x-request-id"))


async def _wait_ready(client: httpx.AsyncClient) -> str | None:
    """None once the model is ready; the reason it never will be otherwise (a failed load or self-check)."""
    while True:
        response = await client.get("/ready")
        if response.status_code == 200:
            return None
        body = response.json()
        if body.get("status") not in ("loading",):
            return str(body.get("detail") or body.get("status"))
        await asyncio.sleep(0.2)


async def run(
    app,
    input_path: Path,
    output_path: Path,
    max_in_flight: int,
    read_ahead: int,
    progress: bool = True,
    log=None,
) -> Summary:
    """Score INPUT into OUTPUT through `app` (app.server.create_app's), as the module says."""
    from tqdm import tqdm

    summary = Summary()
    started = time.perf_counter()
    after_line, summary.resumed = resume_point(input_path, output_path)
    total = count_rows(input_path, after_line)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def interrupt() -> None:
        stop.set()
        loop.remove_signal_handler(signal.SIGINT)  # a second Ctrl-C: KeyboardInterrupt, at once

    with contextlib.suppress(NotImplementedError, RuntimeError):  # not the main thread (tests): no handler
        loop.add_signal_handler(signal.SIGINT, interrupt)
    transport = httpx.ASGITransport(app=app)
    bar = tqdm(
        total=total,
        desc="scoring",
        unit="row",
        disable=not progress,
        file=sys.stderr,
        dynamic_ncols=True,
        smoothing=0.05,
    )
    try:
        async with (
            app.router.lifespan_context(app),
            httpx.AsyncClient(transport=transport, base_url="http://clef-batch", timeout=None) as client,
        ):
            reason = await _wait_ready(client)
            if reason is not None:
                raise RuntimeError(f"the model is not ready: {reason}")
            summary.loading_seconds = time.perf_counter() - started
            started = time.perf_counter()
            if log is not None and summary.resumed:
                log.info("resuming: %d rows already in %s (up to line %d)", summary.resumed, output_path, after_line)
            held = load_held(output_path, after_line)
            with (
                open(input_path, encoding="utf-8", errors="surrogateescape") as source,
                open(output_path, "a", encoding="utf-8") as sink,
            ):
                rows = read_rows(source, after_line)
                unwritten, still_restored = await _score(
                    client, rows, sink, held, summary, bar, stop, max_in_flight, read_ahead
                )
            summary.held = len(unwritten.keys() - still_restored)
            save_held(output_path, unwritten | held)  # held: an earlier interruption's, not reached this time
    finally:
        bar.close()
        summary.seconds = time.perf_counter() - started
        summary.interrupted = stop.is_set()
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.remove_signal_handler(signal.SIGINT)
    return summary


async def _score(
    client,
    rows: Iterator[Row],
    sink: TextIO,
    held: dict[int, dict[str, Any]],
    summary: Summary,
    bar,
    stop: asyncio.Event,
    max_in_flight: int,
    read_ahead: int,
) -> tuple[dict[int, dict[str, Any]], set[int]]:
    """Feeds the engine and writes in input order until INPUT is done or `stop` is set; returns the rows
    answered that could not be written yet (interrupted: some row before them was not asked), and which of
    them came from `held`: such rows from an interrupted run (line -> record), written in their place
    instead of being asked again."""
    scheduler = Scheduler()
    order: deque[int] = deque()  # the lines read and not yet written, in input order
    finished: dict[int, dict[str, Any]] = {}  # answered rows waiting for the rows before them
    restored: set[int] = set()  # the lines of `finished` taken from `held`
    sizes: dict[int, int] = {}  # the bytes of each row in `order`
    buffered = 0  # their sum
    in_flight: dict[asyncio.Task, Row] = {}
    exhausted = False

    def write_ready() -> int:
        """Writes the answered rows at the head of `order`; how many."""
        nonlocal buffered
        written = 0
        while order and order[0] in finished:
            number = order.popleft()
            buffered -= sizes.pop(number)
            line = finished.pop(number)
            sink.write(json.dumps(line, ensure_ascii=False) + "\n")
            summary.count(line, restored=number in restored)
            restored.discard(number)
            written += 1
        sink.flush()
        bar.update(written)
        bar.set_postfix(
            ok=summary.ok, refused=summary.refused, failed=summary.failed, hits=summary.prefix_hits, refresh=False
        )
        return written

    def read_ahead_of_writing() -> None:
        nonlocal exhausted, buffered
        while not stop.is_set() and not exhausted and len(order) < read_ahead:
            if order and buffered >= READ_AHEAD_BYTES:
                break
            row = next(rows, None)
            if row is None:
                exhausted = True
                break
            order.append(row.line)
            sizes[row.line] = len(row.body)
            buffered += len(row.body)
            kept = held.pop(row.line, None)
            if kept is not None and kept.get("custom_id") == row.custom_id:
                finished[row.line] = kept  # answered before an interruption
                restored.add(row.line)
            else:
                scheduler.add(row)

    while True:
        read_ahead_of_writing()
        while write_ready():  # rows held from an interrupted run need no asking: more room to read
            read_ahead_of_writing()
        while not stop.is_set() and len(in_flight) < max_in_flight:
            row = scheduler.next()
            if row is None:
                break
            in_flight[asyncio.ensure_future(_post(client, row))] = row
        if not in_flight:
            break  # everything read is written, or (interrupted) the rows in flight are done
        done, _ = await asyncio.wait(list(in_flight), return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            row = in_flight.pop(task)
            scheduler.done(row)
            finished[row.line] = task.result()
        write_ready()
    write_ready()
    return finished, restored


def held_path(output_path: Path) -> Path:
    """Where an interrupted run keeps the rows it answered past a row it had not asked yet (OUTPUT is written
    in input order): the next run writes them in their place."""
    return output_path.with_name(output_path.name + ".held")


def load_held(output_path: Path, after_line: int) -> dict[int, dict[str, Any]]:
    """An interrupted run's held rows after `after_line` (at most its read-ahead); a torn line is dropped
    (that row is asked again)."""
    path, held = held_path(output_path), {}
    if path.exists():
        with open(path, encoding="utf-8") as source:
            for text in source:
                with contextlib.suppress(ValueError, KeyError, TypeError):
                    line = json.loads(text)
                    if isinstance(line["line"], int) and line["line"] > after_line:
                        held[line["line"]] = line
    return held


def save_held(output_path: Path, rows: dict[int, dict[str, Any]]) -> None:
    """Replaces the held file with `rows` (none: removed); written whole, then renamed over the old one."""
    path = held_path(output_path)
    if not rows:
        path.unlink(missing_ok=True)
        return
    partial = path.with_name(path.name + ".partial")
    with open(partial, "w", encoding="utf-8") as sink:
        for line in sorted(rows):
            sink.write(json.dumps(rows[line], ensure_ascii=False) + "\n")
    os.replace(partial, path)


def check_paths(input_path: str, output_path: str) -> tuple[Path, Path]:
    """The CLI's checks before anything loads (BatchFileError: one line, exit 2)."""
    source, sink = Path(input_path), Path(output_path)
    if not source.is_file():
        raise BatchFileError(f"INPUT {input_path}: no such file")
    if not os.access(source, os.R_OK):
        raise BatchFileError(f"INPUT {input_path}: not readable")
    if sink.exists() and (sink.is_dir() or sink.resolve() == source.resolve()):
        raise BatchFileError(f"OUTPUT {output_path}: {'a directory' if sink.is_dir() else 'the same file as INPUT'}")
    if not sink.parent.resolve().is_dir():
        raise BatchFileError(f"OUTPUT {output_path}: its directory does not exist")
    if sink.exists() and not os.access(sink, os.W_OK) or not os.access(sink.parent.resolve(), os.W_OK):
        raise BatchFileError(f"OUTPUT {output_path}: not writable")
    return source, sink
