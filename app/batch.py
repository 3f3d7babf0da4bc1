"""`clef-serve batch INPUT.jsonl OUTPUT.jsonl`: score a file of System One requests offline, as vLLM's
`run-batch` does for chat requests, with the server's own pipeline and answers.

Input: one request per line, either a System One body or the OpenAI / vLLM batch form
`{"custom_id": "...", "method": "POST", "url": "/v1/systemone", "body": {...}}` (`url` may also be the Workers
AI route, `/client/v4/accounts/<id>/ai/run/@cf/cloudflare/<model>`); blank lines are skipped.
Output: one line per request, in input order:
`{"id", "custom_id", "line", "status": "ok" | "refused" | "failed", "response": {"status_code", "request_id",
"body"}, "error": null | {"code", "message"}}`; `body` is exactly what the server would have answered, the
contract's error body for a refused row. `id` is `clef-batch-<line>-<a digest of the line's bytes>`. A line
that is not UTF-8 is that row's error, not the run's: a plain body goes to the server as it is (its 422), a
wrapper is refused here (400), its custom_id decoded with U+FFFD for the bad bytes.

How it runs:
- Each row goes through the FastAPI app in-process (the same validation, limits, errors and answers as the
  server: a row the server would refuse is recorded with that refusal, and the run goes on). No socket.
- The engine is kept fed: up to `max_in_flight` rows in flight (continuous batching does the rest), read
  `read_ahead` rows ahead of the last one written. Rows with the same state (and model, images and videos) are
  scheduled together: the first goes alone, the rest once it is done, so they start from its prefix-cache
  snapshot instead of prefilling the state again; other states fill the engine meanwhile.
- Memory is bounded by `read_ahead` rows (and READ_AHEAD_BYTES of them), whatever the file's length: the
  input is read as it is needed and each answer written (and flushed) as soon as every row before it is.
- Resumable: OUTPUT is appended to. A rerun checks that OUTPUT's rows are INPUT's rows in order, each
  record's id (its line and the digest of the line's bytes) against INPUT's line (exit 2 if not: another file,
  or one edited since), drops a torn last line, and starts after the last row written. With `retry_failed`
  (`--retry-failed`) the rows recorded "failed" are asked again: OUTPUT is cut at the first of them and the
  rows after it that did not fail go to OUTPUT.held, written back in their place without being asked.
  SIGINT (Ctrl-C) stops asking: the rows in flight finish, what can be written in order is, and the rows
  answered past a row not yet asked go to OUTPUT.held, which the rerun writes in their place (nothing
  answered is asked twice); a second SIGINT stops at once (the rows in flight, and any not yet written,
  are asked again by the rerun).
- A 503 (a step out of memory, a busy rank; on the Workers AI route a 429 or 529 with Retry-After) is
  retried after its Retry-After, three times; a row that still fails, or gets any other 5xx, is recorded
  "failed". But a 5xx while /ready says the server will not answer again (a shadow mismatch or a failed
  timed self-check under enforce) stops the run: that row and the ones after it are not written (they are
  asked by the rerun, once the server answers), rows answered past it are held as on SIGINT.
- Exit 0 when every row was answered or refused, 1 when some failed, the model never became ready or the
  server's verification stopped the run (the reason printed), 130 when interrupted.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import itertools
import json
import os
import re
import signal
import sys
import time
from collections import OrderedDict, deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple

import httpx

DECISION_URL = "/v1/systemone"
_WORKERS_AI_URL = re.compile(r"/client/v4/accounts/[^/]+/ai/run/\S+")
WRAPPER_FIELDS = frozenset({"custom_id", "method", "url", "body"})
RETRIES_ON_503 = 3
# Retried after their Retry-After: 503 (our overload, a step out of memory); the Workers AI route's 429/3040 and
# 529/5012 when they carry one (capacity, a step that failed: not a model error, which has none).
RETRIED_WITH_RETRY_AFTER = frozenset({429, 529})
# /ready's statuses under which the server will not answer again (until an operator restarts it).
NEVER_ANSWERS = frozenset({"verification_failed", "selfcheck_failed", "failed"})
# Rows read ahead are bounded in bytes too: a row may carry megabytes of images (the server takes 48 MiB).
READ_AHEAD_BYTES = 256 * 2**20
EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 1, 2, 130


class BatchFileError(ValueError):
    """INPUT or OUTPUT cannot be used (the CLI prints it as one line, exit 2)."""


class ServerRefuses(Exception):
    """The server answered a row with a 5xx and /ready says it will not answer again (its verification
    failed): the run stops, the row unwritten."""


@dataclasses.dataclass
class Row:
    line: int  # 1-based line number in INPUT
    custom_id: str | None
    url: str
    body: bytes  # what is POSTed: the line itself, or its "body" re-encoded
    group: bytes | None  # rows with one state, model, images and videos share it; None: a group of its own
    refusal: tuple[int, dict[str, Any]] | None = None  # a wrapper this command refuses itself (a bad url)
    attempts: int = 0
    digest: str = ""  # of the line's bytes: OUTPUT's record of this row is for this very line

    @property
    def record_id(self) -> str:
        return f"clef-batch-{self.line}-{self.digest}"


def _refusal(status: int, message: str) -> tuple[int, dict[str, Any]]:
    return status, {"detail": {"error_type": "invalid_request_error", "message": message}}


def _group_of(body: Any) -> bytes | None:
    """What decides a prefix-cache hit between two rows: the model, the images, the videos and the state (the
    record puts them before the questions), the images and videos in any wire form (`images`, `videos`, or
    `assets` of either type)."""
    if not isinstance(body, dict) or "state" not in body:
        return None
    media = [body.get(field) for field in ("images", "videos", "assets")]
    key = json.dumps([body.get("model"), *media, body.get("state")], sort_keys=True, default=str)
    return hashlib.blake2b(key.encode(), digest_size=16).digest()


def _is_wrapper(parsed: Any) -> bool:
    return isinstance(parsed, dict) and "body" in parsed and set(parsed) <= WRAPPER_FIELDS


def parse_row(number: int, line: bytes) -> Row | None:
    """One input line (its bytes) as a Row; None for a blank one. Never raises: a line that is not JSON, or a
    plain body that is not UTF-8, is sent as it is (the server's 422 is recorded for it); a wrapper with a url
    other than a decision route, or that is not UTF-8, is refused here."""
    raw = line.rstrip(b"\r\n")
    if not raw.strip():
        return None
    digest = hashlib.blake2b(raw, digest_size=8).hexdigest()
    try:
        text = raw.decode("utf-8-sig")  # what the server takes: UTF-8, a leading BOM tolerated
    except UnicodeDecodeError as error:
        return _not_utf8(number, raw, digest, error)
    try:
        parsed = json.loads(text)
    except ValueError:
        return Row(number, None, DECISION_URL, raw, None, digest=digest)
    if not _is_wrapper(parsed):
        return Row(number, None, DECISION_URL, raw, _group_of(parsed), digest=digest)
    custom_id = parsed.get("custom_id")
    url = parsed.get("url", DECISION_URL)
    row = Row(number, custom_id if isinstance(custom_id, str) else None, DECISION_URL, b"", None, digest=digest)
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


def _not_utf8(number: int, raw: bytes, digest: str, error: UnicodeDecodeError) -> Row:
    """A line with bytes that are not UTF-8: a plain body goes to the server as it is (its 422 names them); a
    wrapper is refused here, with its custom_id as far as it can be read (U+FFFD for the bad bytes: OUTPUT is
    UTF-8)."""
    try:
        parsed = json.loads(raw.decode("utf-8", "replace"))
    except ValueError:
        parsed = None
    if not _is_wrapper(parsed):
        return Row(number, None, DECISION_URL, raw, None, digest=digest)
    custom_id = parsed.get("custom_id")
    row = Row(number, custom_id if isinstance(custom_id, str) else None, DECISION_URL, b"", None, digest=digest)
    bad = raw[error.start : error.end].hex(" ")
    row.refusal = _refusal(
        400, f"line {number} is not UTF-8 (byte {error.start + 1}: {bad}): a batch row is a JSON line in UTF-8"
    )
    return row


def read_rows(source: BinaryIO, start_line: int = 0) -> Iterator[Row]:
    """INPUT's rows after line `start_line`, one at a time (INPUT opened in binary: a line is split at b"\n"
    only, and its bytes are kept as they are)."""
    for number, line in enumerate(source, start=1):
        if number > start_line:
            row = parse_row(number, line)
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
        "id": row.record_id,
        "custom_id": row.custom_id,
        "line": row.line,
        "status": outcome,
        "response": {"status_code": status, "request_id": request_id, "body": body},
        "error": error,
    }


class ResumePoint(NamedTuple):
    after_line: int  # the last input line OUTPUT answers: the run starts after it
    rows: int  # the rows OUTPUT holds
    retried: int  # retry_failed: the "failed" rows cut from OUTPUT, to be asked again


def resume_point(input_path: Path, output_path: Path, retry_failed: bool = False) -> ResumePoint:
    """Where a run into OUTPUT starts, after checking that OUTPUT's rows are INPUT's in order, each the record
    of the very line it names (its id: the line's number and the digest of its bytes). A torn last line (a run
    killed mid-write) is cut off. With `retry_failed`, OUTPUT is cut at its first "failed" row, the rows after
    it that did not fail set aside in OUTPUT.held first (a crash between the two loses nothing). BatchFileError
    when OUTPUT is another file's, or INPUT changed under it."""
    if not output_path.exists():
        return ResumePoint(0, 0, 0)
    last_line, rows, keep = 0, 0, 0
    first_failed: tuple[int, int, int] | None = None  # (its offset, the last line and the rows before it)
    failed = 0
    with open(input_path, "rb") as source, open(output_path, "rb") as written:
        expected = read_rows(source)
        for raw in written:
            if not raw.endswith(b"\n"):
                break  # torn: cut below
            try:
                done = json.loads(raw)
                line, custom_id, record_id = done["line"], done.get("custom_id"), done.get("id")
            except (ValueError, KeyError, TypeError, AttributeError) as error:
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
            if record_id != want.record_id:
                raise BatchFileError(
                    f"OUTPUT {output_path} does not continue INPUT {input_path}: its row {rows + 1} ({record_id!r}) "
                    f"answers other content than INPUT's line {line} ({want.record_id!r}: INPUT is another file "
                    "or was edited); choose another OUTPUT"
                )
            if done.get("status") == "failed":
                failed += 1
                if first_failed is None:
                    first_failed = (keep, last_line, rows)
            last_line, rows, keep = line, rows + 1, keep + len(raw)
    if retry_failed and first_failed is not None:
        _set_aside(output_path, first_failed[0], keep, last_line)
        keep, last_line, rows = first_failed
    if keep != output_path.stat().st_size:
        with open(output_path, "r+b") as written:
            written.truncate(keep)
    return ResumePoint(last_line, rows, failed if retry_failed else 0)


def _set_aside(output_path: Path, cut: int, end: int, last_line: int) -> None:
    """OUTPUT.held becomes OUTPUT's records between bytes `cut` and `end` that did not fail, then the held
    records past OUTPUT's `last_line` (in line order, as HeldRows reads them), streamed: no file in memory."""
    path = held_path(output_path)
    partial = path.with_name(path.name + ".partial")
    held = HeldRows(output_path, last_line)
    try:
        with open(output_path, "rb") as written, open(partial, "wb") as sink:
            written.seek(cut)
            offset = cut
            while offset < end:
                raw = written.readline()
                offset += len(raw)
                if json.loads(raw).get("status") != "failed":
                    sink.write(raw)
            for record in held.rest():
                sink.write(encode_record(record))
    finally:
        held.close()
    os.replace(partial, path)


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
    retried: int = 0  # of those, the "failed" ones cut from OUTPUT to be asked again (--retry-failed)
    restored: int = 0  # of the rows, those an earlier run had answered and held (OUTPUT.held)
    held: int = 0  # stopped: rows answered past a row not yet asked, left in OUTPUT.held for the rerun
    input_tokens: int = 0
    cached_tokens: int = 0
    prefix_hits: int = 0  # answered rows that started from a prefix-cache snapshot
    seconds: float = 0.0  # scoring, from the model ready to the last row written
    loading_seconds: float = 0.0  # the start-up before it: self-check, autotune, warm-up
    interrupted: bool = False
    stopped: str | None = None  # why the server's verification stopped the run (/ready's reason)
    stopped_at: int = 0  # the first line it refused (not written: the rerun asks it)

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
        held = f" ({self.restored} answered by an earlier run and held)" if self.restored else ""
        resumed = f"; {self.resumed} written by an earlier run" if self.resumed else ""
        retried = f"; {self.retried} failed rows of an earlier run asked again" if self.retried else ""
        stopped = ""
        if self.stopped is not None:
            stopped = (
                f"; stopped at line {self.stopped_at}, the server refuses to answer ({self.stopped}): "
                f"{self.held} more answered and held, rerun once it answers to resume"
            )
        elif self.interrupted:
            stopped = f"; interrupted: {self.held} more answered and held, rerun to resume"
        return (
            f"{self.rows} rows: {self.ok} ok, {self.refused} refused, {self.failed} failed{held}{resumed}{retried}; "
            f"{self.input_tokens} input tokens, {self.cached_tokens} from the prefix cache, {hits}; "
            f"{self.seconds:.1f} s, {rate:.2f} rows/s (after {self.loading_seconds:.1f} s of start-up){stopped}"
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
    except ServerRefuses:
        raise
    except Exception as error:
        message = f"the batch runner failed: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        return record(row, 500, {"detail": {"error_type": "internal_error", "message": message}}, None)


async def _post_until_answered(client: httpx.AsyncClient, row: Row) -> dict[str, Any]:
    while True:
        row.attempts += 1
        response = await client.post(row.url, content=row.body, headers={"Content-Type": "application/json"})
        if response.status_code >= 500:
            reason = await _never_answers(client)
            if reason is not None:
                raise ServerRefuses(reason)
        retried = response.status_code == 503 or (
            response.status_code in RETRIED_WITH_RETRY_AFTER and "retry-after" in response.headers
        )
        if retried and row.attempts <= RETRIES_ON_503:
            await asyncio.sleep(min(float(response.headers.get("retry-after", "1") or 1), 30.0))
            continue
        try:
            body = response.json()
        except ValueError:
            body = response.text
        return record(row, response.status_code, body, response.headers.get("x-request-id"))


def _unready_reason(body: Any) -> str:
    """/ready's 503 body in a line: its message, else its status."""
    detail = body.get("detail") if isinstance(body, dict) else None
    if isinstance(detail, dict) and detail.get("message"):
        return str(detail["message"])
    return str(body.get("status") if isinstance(body, dict) else body)


async def _wait_ready(client: httpx.AsyncClient) -> str | None:
    """None once the model is ready; the reason it never will be otherwise (a failed load or self-check)."""
    while True:
        response = await client.get("/ready")
        if response.status_code == 200:
            return None
        body = response.json()
        if body.get("status") not in ("loading",):
            return _unready_reason(body)
        await asyncio.sleep(0.2)


async def _never_answers(client: httpx.AsyncClient) -> str | None:
    """After a 5xx: why the server will not answer again (/ready's reason: a shadow mismatch or a failed
    self-check, enforced), else None (that 5xx was the row's own failure)."""
    response = await client.get("/ready")
    if response.status_code == 200:
        return None
    try:
        body = response.json()
    except ValueError:
        return None
    if not isinstance(body, dict) or body.get("status") not in NEVER_ANSWERS:
        return None
    return _unready_reason(body)


async def run(
    app,
    input_path: Path,
    output_path: Path,
    max_in_flight: int,
    read_ahead: int,
    progress: bool = True,
    log=None,
    retry_failed: bool = False,
) -> Summary:
    """Score INPUT into OUTPUT through `app` (app.server.create_app's), as the module says."""
    from tqdm import tqdm

    summary = Summary()
    started = time.perf_counter()
    after_line, summary.resumed, summary.retried = resume_point(input_path, output_path, retry_failed)
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
            held = HeldRows(output_path, after_line)
            try:
                with open(input_path, "rb") as source, open(output_path, "ab") as sink:
                    rows = read_rows(source, after_line)
                    unwritten, still_restored, refusal = await _score(
                        client, rows, sink, held, summary, bar, stop, max_in_flight, read_ahead
                    )
                summary.held = len(unwritten.keys() - still_restored)
                if refusal is not None:
                    summary.stopped_at, summary.stopped = refusal
                save_held(output_path, unwritten, held.rest())  # the rest: held earlier, not reached this time
            finally:
                held.close()
    finally:
        bar.close()
        summary.seconds = time.perf_counter() - started
        summary.interrupted = stop.is_set() and summary.stopped is None
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.remove_signal_handler(signal.SIGINT)
    return summary


async def _score(
    client,
    rows: Iterator[Row],
    sink: BinaryIO,
    held: HeldRows,
    summary: Summary,
    bar,
    stop: asyncio.Event,
    max_in_flight: int,
    read_ahead: int,
) -> tuple[dict[int, dict[str, Any]], set[int], tuple[int, str] | None]:
    """Feeds the engine and writes in input order until INPUT is done or `stop` is set; returns the rows
    answered that could not be written yet (stopped: some row before them was not asked, or refused), which
    of them came from `held` (an earlier run's answers, written in their place instead of being asked again),
    and, when the server's verification stopped the run, the first line it refused and why. The server
    refusing a row sets `stop`."""
    scheduler = Scheduler()
    order: deque[int] = deque()  # the lines read and not yet written, in input order
    finished: dict[int, dict[str, Any]] = {}  # answered rows waiting for the rows before them
    restored: set[int] = set()  # the lines of `finished` taken from `held`
    sizes: dict[int, int] = {}  # the bytes of each row in `order`
    buffered = 0  # their sum
    in_flight: dict[asyncio.Task, Row] = {}
    exhausted = False
    refusal: tuple[int, str] | None = None  # the first line the server refused to answer, and why

    def write_ready() -> int:
        """Writes the answered rows at the head of `order`; how many."""
        nonlocal buffered
        written = 0
        while order and order[0] in finished:
            number = order.popleft()
            buffered -= sizes.pop(number)
            line = finished.pop(number)
            sink.write(encode_record(line))
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
            kept = held.take(row.line)
            if kept is not None and kept.get("id") == row.record_id:  # the record of this very line
                finished[row.line] = kept  # answered by an earlier run
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
            try:
                finished[row.line] = task.result()
            except ServerRefuses as error:  # unwritten: the rerun asks it, and the rows after it not yet asked
                stop.set()
                if refusal is None or row.line < refusal[0]:
                    refusal = (row.line, str(error))
        write_ready()
    write_ready()
    return finished, restored, refusal


def held_path(output_path: Path) -> Path:
    """Where an interrupted run keeps the rows it answered past a row it had not asked yet (OUTPUT is written
    in input order): the next run writes them in their place."""
    return output_path.with_name(output_path.name + ".held")


class HeldRows:
    """OUTPUT.held's records past `after_line`, read as the run reaches their lines (they are in line order, as
    save_held writes them): one record in memory, however many are held. A torn or unreadable line, or one out
    of order, is passed over (its row is asked again)."""

    def __init__(self, output_path: Path, after_line: int):
        path = held_path(output_path)
        self._source: BinaryIO | None = open(path, "rb") if path.exists() else None  # noqa: SIM115
        self._last = after_line
        self._next: dict[str, Any] | None = None
        self._advance()

    def _advance(self) -> None:
        self._next = None
        while self._source is not None:
            raw = self._source.readline()
            if not raw:
                self.close()
                return
            try:
                record = json.loads(raw) if raw.endswith(b"\n") else None
            except ValueError:
                continue
            line = record.get("line") if isinstance(record, dict) else None
            if isinstance(line, int) and line > self._last:
                self._next, self._last = record, line
                return

    def take(self, line: int) -> dict[str, Any] | None:
        """The record held for `line`, if any (records of earlier lines are passed over: no row asks for them)."""
        while self._next is not None and self._next["line"] < line:
            self._advance()
        if self._next is None or self._next["line"] != line:
            return None
        record = self._next
        self._advance()
        return record

    def rest(self) -> Iterator[dict[str, Any]]:
        """The records not taken yet, in line order."""
        while self._next is not None:
            record = self._next
            self._advance()
            yield record

    def close(self) -> None:
        if self._source is not None:
            self._source.close()
            self._source = None


def encode_record(record: dict[str, Any]) -> bytes:
    """A record's line in UTF-8. A string with a lone surrogate (a custom_id of "\\udc80" is legal JSON, not
    UTF-8) is written escaped, as it came, instead of failing the run."""
    try:
        return (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8")
    except UnicodeEncodeError:
        return (json.dumps(record) + "\n").encode("ascii")


def save_held(output_path: Path, rows: dict[int, dict[str, Any]], more: Iterator[dict[str, Any]] = ()) -> None:
    """Replaces the held file with `rows` then `more` (records past every one of `rows`, in line order); none
    at all: removed. Written whole, then renamed over the old one (which `more` may still be reading)."""
    path = held_path(output_path)
    partial = path.with_name(path.name + ".partial")
    written = 0
    with open(partial, "wb") as sink:
        for record in itertools.chain((rows[line] for line in sorted(rows)), more):
            sink.write(encode_record(record))
            written += 1
    if written:
        os.replace(partial, path)
    else:
        partial.unlink()
        path.unlink(missing_ok=True)


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
