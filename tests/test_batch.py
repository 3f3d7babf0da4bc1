"""`clef-serve batch` (app/batch.py): the server's answers and refusals for every row, in input order; rows with
one state scheduled after their first so they start from its prefix-cache snapshot; a Ctrl-C'd run resumed
without asking a row twice or losing one; memory bounded by the read-ahead, not the file."""

from __future__ import annotations

import asyncio
import json
import logging
import random
import re
import signal
import subprocess
import sys

import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient
from live import WAIT_SECONDS, wait_until
from random_requests import random_request
from releases import tiny_release

from app import batch
from app.cli import main
from app.server import ServerSettings, create_app
from clef_cuda import Decider
from clef_cuda.serving.engine import Engine, EngineConfig

WORDS = "checkout fails login slow error db web timeout refund payment page crash".split()


@pytest.fixture(scope="module")
def decider():
    return Decider.from_release(tiny_release(), device="cpu", progress=False)


def make_app(decider, **config):
    defaults = dict(
        max_num_seqs=4, prefill_chunk_size=256, max_model_len=8192, allow_long_context=True, kv_fraction=0.2
    )
    return create_app(
        ServerSettings(max_body_bytes=100_000), engine=Engine(decider, EngineConfig(**(defaults | config)))
    )


def score(app, tmp_path, lines: list[str], max_in_flight=16, read_ahead=64, name="out.jsonl"):
    source, sink = tmp_path / "in.jsonl", tmp_path / name
    source.write_text("".join(line + "\n" for line in lines))
    summary = asyncio.run(batch.run(app, source, sink, max_in_flight, read_ahead, progress=False))
    return summary, [json.loads(line) for line in sink.read_text().splitlines()]


def ticket(number: int, words: int = 300) -> str:
    rng = random.Random(number)
    return f"ticket {number}: " + " ".join(rng.choice(WORDS) for _ in range(words))


def test_every_row_gets_what_the_server_answers_in_input_order(decider, tmp_path):
    """Answers (4 decimals, identical), refusals (the same status and body) and the route's own forms: a plain
    body, the OpenAI/vLLM wrapper with a custom_id, the Workers AI url, a line that is not JSON, a blank line
    (skipped), 300 options, a state over the budget, a url this command does not serve."""
    rng = random.Random(5)
    bodies = [random_request(rng, null_score_levels=False) for _ in range(10)]
    lines = [json.dumps(b) for b in bodies[:4]]
    lines += [
        json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/systemone", "body": b})
        for i, b in enumerate(bodies[4:8])
    ]
    workers_ai = "/client/v4/accounts/acct/ai/run/@cf/cloudflare/clef-flash"
    lines += [json.dumps({"custom_id": "hosted", "url": workers_ai, "body": bodies[8]}), "{not json", ""]
    too_many = {"pick": {"type": "choice", "criteria": {f"o{i}": "" for i in range(300)}}}
    lines += [json.dumps(bodies[9] | {"questions": too_many}), json.dumps(bodies[9] | {"state": "word " * 9000})]
    lines += [json.dumps({"custom_id": "elsewhere", "url": "/v1/load_lora_adapter", "body": bodies[9]})]
    summary, out = score(make_app(decider), tmp_path, lines)

    assert [o["line"] for o in out] == [n for n, line in enumerate(lines, 1) if line]  # the blank line skipped
    assert [o["custom_id"] for o in out[4:9]] == ["c0", "c1", "c2", "c3", "hosted"]
    assert (summary.ok, summary.refused, summary.failed) == (9, 4, 0), [o["error"] for o in out]
    with TestClient(make_app(decider)) as client:
        for record, line in zip(out, [x for x in lines if x], strict=True):
            parsed = json.loads(line) if line.startswith('{"') else None
            url, body = (
                (parsed.get("url", "/v1/systemone"), parsed["body"])
                if parsed and "body" in parsed
                else ("/v1/systemone", None)
            )
            if record["custom_id"] == "elsewhere":
                assert record["status"] == "refused" and record["response"]["status_code"] == 400
                assert "/v1/load_lora_adapter" in record["error"]["message"]
                continue
            served = client.post(
                url,
                content=json.dumps(body).encode() if body is not None else line.encode(),
                headers={"Content-Type": "application/json"},
            )
            got = record["response"]
            assert got["status_code"] == served.status_code, (record, served.text)
            assert record["status"] == ("ok" if served.status_code == 200 else "refused")
            if served.status_code != 200:
                assert got["body"] == served.json() and record["error"]["message"]
                continue
            expected = served.json()
            mine, theirs = (got["body"].get("result", got["body"]), expected.get("result", expected))
            assert mine["answers"] == theirs["answers"] and mine["usage"] == theirs["usage"]


def test_rows_with_one_state_start_from_the_first_ones_snapshot(decider, tmp_path, monkeypatch):
    """Six states, four question sets each, shuffled: each state's first row prefills it, the other three
    start from its snapshot (every one a hit). The fault: rows taken in file order, as a concurrent client
    sends them, run a state's rows side by side (four pairs are adjacent in this order) and some miss."""
    rng = random.Random(3)
    rows = [(state, q) for state in range(6) for q in range(4)]
    rng.shuffle(rows)
    lines = [
        json.dumps(
            {
                "model": "clef-flash",
                "state": ticket(state),
                "questions": {"q": {"type": "noul", "instructions": f"Question {q}?"}},
            }
        )
        for state, q in rows
    ]
    summary, out = score(make_app(decider), tmp_path, lines, name="grouped.jsonl")
    assert summary.ok == 24 and summary.prefix_hits == 24 - 6, summary.describe()

    def in_file_order(self):
        for key in self.waiting:
            return self._take(key)
        return None

    monkeypatch.setattr(batch.Scheduler, "next", in_file_order)
    fifo, _ = score(make_app(decider), tmp_path, lines, name="fifo.jsonl")
    assert fifo.prefix_hits < summary.prefix_hits, (fifo.describe(), summary.describe())


def test_rows_differing_only_in_a_video_or_an_asset_are_not_one_group():
    """Videos (and assets of either type) sit before the questions in the record: rows that differ in one share
    no prefix past it, so they are different groups (one would otherwise wait on the other's leader for a snapshot
    it cannot use); rows that differ only in their questions are one group, in either input form."""

    def group(**fields) -> bytes:
        body = {"model": "clef-flash", "state": "Camera 4", "questions": {"q": {"type": "noul"}}} | fields
        plain = batch.parse_row(1, json.dumps(body).encode()).group
        wrapped = batch.parse_row(1, json.dumps({"custom_id": "x", "body": body}).encode()).group
        assert plain == wrapped and plain is not None
        return plain

    def asset(kind: str, data: str) -> dict:
        return {"cam": {"type": kind, "format": "mp4" if kind == "video" else "png", "data_base64": data}}

    clip = "data:video/mp4;base64,AAAAGGZ0eXBpc29t"
    assert group(videos=[clip]) == group(videos=[clip], questions={"other": {"type": "noul"}})
    assert group(videos=[clip]) != group(videos=[clip + "AAAA"])
    assert group(videos=[clip]) != group()
    assert group(videos=[clip]) != group(images=[clip])
    assert group(assets=asset("video", "AAAA")) != group(assets=asset("video", "BBBB"))
    assert group(assets=asset("image", "AAAA")) != group(assets=asset("image", "BBBB"))
    assert group(assets=asset("video", "AAAA")) != group()


def test_the_scheduler_holds_a_states_rows_until_its_first_is_done():
    def row(line, group):
        return batch.Row(line, None, "/v1/systemone", b"{}", group)

    scheduler = batch.Scheduler()
    for line, group in enumerate([b"a", b"b", b"a", None, b"a", b"b"], start=1):
        scheduler.add(row(line, group))
    first = [scheduler.next() for _ in range(3)]
    assert [r.line for r in first] == [1, 2, 4]  # a's and b's leaders, the ungrouped row; a's others wait
    assert scheduler.next() is None
    scheduler.done(first[1])  # b's leader done: b's other row goes first
    assert scheduler.next().line == 6
    scheduler.done(first[0])
    assert [scheduler.next().line, scheduler.next().line, scheduler.next()] == [3, 5, None]
    assert scheduler.size == 0


def stub_app(fail_lines=(), busy_lines=(), slow_lines=(), delay=0.0, asked=None) -> FastAPI:
    """A server that answers at once (the runner alone is measured): `fail_lines` get a 500, `busy_lines` a
    503 with Retry-After twice, then their answer; `slow_lines` answer after 0.2 s; `asked` gets each line
    asked."""
    app, tries = FastAPI(), {}

    @app.get("/ready")
    async def ready():
        return {"status": "ready"}

    @app.post("/v1/systemone")
    async def decide(request: Request):
        body = await request.json()
        line = body["line"]
        if asked is not None:
            asked.append(line)
        if delay:
            await asyncio.sleep(delay * random.random())
        if line in slow_lines:
            await asyncio.sleep(0.2)
        if line in fail_lines:
            return _json(500, {"detail": {"error_type": "internal_error", "message": "the server failed: injected"}})
        if line in busy_lines:
            tries[line] = tries.get(line, 0) + 1
        if line in busy_lines and tries[line] <= 2:
            return _json(503, {"detail": {"error_type": "overloaded_error", "message": "busy"}}, {"Retry-After": "0"})
        return {"model": "m", "answers": {"line": line}, "usage": {"input_tokens": 1}, "x_cached_tokens": 0}

    return app


def _json(status, body, headers=None):
    from fastapi.responses import JSONResponse

    return JSONResponse(body, status_code=status, headers=headers)


def test_memory_is_bounded_by_the_read_ahead_not_the_file(tmp_path, monkeypatch):
    """3,000 rows, a read-ahead of 16: never more than 16 rows read past the last one written (the fault,
    a runner that reads the file ahead of the engine, fails this); a 500 is recorded "failed" and the run
    goes on; a 503 is asked again after its Retry-After; a slow row the window waits on, answered last of
    its window, lets the run go on (it once ended the run there)."""
    read, written, worst = [0], [0], [0]
    real_read_rows, real_count = batch.read_rows, batch.Summary.count

    def counting_rows(source, start_line=0):
        for row in real_read_rows(source, start_line):
            read[0] += 1
            worst[0] = max(worst[0], read[0] - written[0])
            yield row

    def counting(self, line, restored=False):
        written[0] += 1
        real_count(self, line, restored)

    monkeypatch.setattr(batch, "read_rows", counting_rows)
    monkeypatch.setattr(batch.Summary, "count", counting)
    lines = [json.dumps({"line": n + 1}) for n in range(3000)]
    app = stub_app(fail_lines={7}, busy_lines={9}, slow_lines={1, 40}, delay=0.002)
    summary, out = score(app, tmp_path, lines, max_in_flight=8, read_ahead=16)
    assert [o["line"] for o in out] == list(range(1, 3001)), summary.describe()
    assert [o["response"]["body"]["answers"]["line"] for o in out if o["status"] == "ok"] == [
        n for n in range(1, 3001) if n != 7
    ]
    assert (summary.ok, summary.failed, out[6]["status"], out[6]["error"]["code"]) == (
        2999,
        1,
        "failed",
        "internal_error",
    )
    assert worst[0] <= 16, worst[0]

    # Rows of 1 KB under an 8 KB byte budget: the bytes bound the read-ahead before the row count does.
    monkeypatch.setattr(batch, "READ_AHEAD_BYTES", 8 * 1024)
    read[0], written[0], worst[0] = 0, 0, 0
    lines = [json.dumps({"line": n + 1, "state": "x" * 1000}) for n in range(200)]
    summary, out = score(stub_app(slow_lines={1}), tmp_path, lines, max_in_flight=8, read_ahead=1000, name="kb.jsonl")
    assert summary.ok == 200 and 8 <= worst[0] <= 9, worst[0]


def batch_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "app", "batch", *args, "--d", "cpu", "--kv-fraction", "0.1", "--no-progress"]


def test_an_interrupted_run_resumes_without_asking_a_row_twice_or_losing_one(tmp_path):
    """SIGINT in the middle of 400 rows: exit 130, OUTPUT whole lines in input order, the answered rows past a
    gap held; the rerun writes the rest, and between them every row was asked exactly once."""
    source, sink = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    with open(source, "w") as f:
        for i in range(400):
            body = {
                "model": "clef-tiny",
                "state": ticket(i % 100),
                "questions": {"q": {"type": "noul", "instructions": f"Q{i % 4}?"}},
            }
            f.write(json.dumps({"custom_id": f"row-{i}", "body": body}) + "\n")
    first = subprocess.Popen(batch_command(str(source), str(sink)), stderr=subprocess.PIPE, text=True)
    wait_until(lambda: sink.exists() and sink.read_text().count("\n") >= 20 or first.poll() is not None, "20 rows")
    first.send_signal(signal.SIGINT)
    _, first_log = first.communicate(timeout=WAIT_SECONDS)
    assert first.returncode == 130, first_log
    written = sink.read_text()
    assert written.endswith("\n") and 20 <= written.count("\n") < 400, first_log
    held = batch.held_path(sink)
    held_rows = held.read_text().count("\n") if held.exists() else 0
    first = re.search(r"^(\d+) rows: .*; interrupted: (\d+) more answered and held", first_log, re.M)
    assert int(first.group(2)) == held_rows, first_log  # every row answered is written or held, none dropped
    first_asked = int(first.group(1)) + held_rows

    second = subprocess.run(batch_command(str(source), str(sink)), stderr=subprocess.PIPE, text=True, timeout=600)
    assert second.returncode == 0, second.stderr
    out = [json.loads(line) for line in sink.read_text().splitlines()]
    assert [o["custom_id"] for o in out] == [f"row-{i}" for i in range(400)]
    assert {o["status"] for o in out} == {"ok"} and not held.exists()
    summary = re.search(r"^(\d+) rows: .*?(?:\((\d+) answered by an earlier run and held\))?;", second.stderr, re.M)
    restored = int(summary.group(2) or 0)
    assert restored == held_rows
    second_asked = int(summary.group(1)) - restored
    assert first_asked + second_asked == 400, (first_log, second.stderr)
    assert len({o["response"]["request_id"] for o in out}) == 400  # each row's answer its own request's


def test_bad_paths_and_another_files_output_are_one_line_and_exit_2(tmp_path, capsys):
    source = tmp_path / "in.jsonl"
    source.write_text(json.dumps({"state": "x", "questions": {"q": {"type": "noul"}}}) + "\n")
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"id": "clef-batch-9", "custom_id": "z", "line": 9, "status": "ok"}) + "\n")
    cases = {
        "no such file": ["batch", str(tmp_path / "missing.jsonl"), str(tmp_path / "o.jsonl")],
        "the same file as INPUT": ["batch", str(source), str(source)],
        "does not continue INPUT": ["batch", str(source), str(other)],
        "its directory does not exist": ["batch", str(source), str(tmp_path / "nowhere" / "o.jsonl")],
        "the following arguments are required": ["batch", str(source)],
    }
    for words, argv in cases.items():
        with pytest.raises(SystemExit) as exited:
            main(argv)
        message = capsys.readouterr().err
        assert exited.value.code == 2 and words in message and message.count("\n") == 1, (words, message)
    assert other.read_text().count("\n") == 1  # refused, never truncated or appended to


@pytest.fixture
def cli_logging(monkeypatch):
    """main() replaces the root logger's handlers with one on (pytest's captured) stderr: put them back after."""
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", list(root.handlers))
    monkeypatch.setattr(root, "level", root.level)


def noul_rows(count: int, tag: str = "", model: str = "clef-tiny") -> list[str]:
    """Plain System One bodies (no custom_id: only their content tells two files apart)."""
    return [
        json.dumps(
            {
                "model": model,
                "state": f"{tag}{ticket(i, words=12)}",
                "questions": {"q": {"type": "noul", "instructions": "An outage?"}},
            }
        )
        for i in range(count)
    ]


def test_a_verification_refusal_stops_the_run_and_the_rerun_asks_the_rest(
    decider, tmp_path, monkeypatch, capsys, cli_logging
):
    """The shadow check fails (enforce) after 5 rows are written: the server refuses every decision from then
    on. The run stops, exit 1 with the reason; OUTPUT holds only answered rows (none "failed"), the ones past
    the refused row held; the rerun, on a server that answers (restarted), writes the rest, none asked twice.
    The old behaviour, each remaining row retried three times and written "failed" (a rerun never asking them
    again), fails this."""
    from app.cli import batch as batch_command

    engines, asked = [], []
    config = EngineConfig(
        max_num_seqs=4, prefill_chunk_size=256, max_model_len=8192, allow_long_context=True, kv_fraction=0.2
    )

    class CountingEngine(Engine):
        def submit(self, request, *args, **kwargs):
            asked.append(request["state"])
            return super().submit(request, *args, **kwargs)

    def engine_for(args, on_lost=None):
        engines.append(CountingEngine(decider, config))
        return engines[-1]

    real_count = batch.Summary.count

    def count_then_fail(self, line, restored=False):
        real_count(self, line, restored)
        if len(engines) == 1 and self.rows == 5:
            engines[0].shadow.on_mismatch(3, "3 shadow mismatches (injected)")  # as the lifecycle wired it

    monkeypatch.setattr(batch_command, "make_engine", engine_for)
    monkeypatch.setattr(batch.Summary, "count", count_then_fail)
    source, sink = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = noul_rows(40)
    source.write_text("".join(line + "\n" for line in lines))
    argv = ["batch", str(source), str(sink), "--d", "cpu", "--selfcheck", "off", "--autotune", "off"]
    argv += ["--max-in-flight", "8", "--no-progress"]

    assert main(argv) == 1
    err = capsys.readouterr().err
    stopped = [line for line in err.splitlines() if line.startswith("clef-serve batch: stopped")]
    assert len(stopped) == 1 and "3 shadow mismatches (injected)" in stopped[0], err
    first = [json.loads(line) for line in sink.read_text().splitlines()]
    assert 5 <= len(first) < 40 and {o["status"] for o in first} == {"ok"}, [o["error"] for o in first]
    assert [o["line"] for o in first] == list(range(1, len(first) + 1))

    assert main(argv) == 0, capsys.readouterr().err
    out = [json.loads(line) for line in sink.read_text().splitlines()]
    assert [o["line"] for o in out] == list(range(1, 41)) and {o["status"] for o in out} == {"ok"}
    assert out[: len(first)] == first and not batch.held_path(sink).exists()
    states = {json.loads(line)["state"] for line in lines}
    asked = [state for state in asked if state in states]  # not the warm-up
    assert set(asked) == states  # every row asked: none left "failed" and never asked again
    assert len(asked) - len(states) <= 8  # only rows the server refused (at most those in flight) asked twice


def test_retry_failed_asks_the_failed_rows_again_and_only_them(tmp_path):
    """Rows 1, 7 and 30 of 30 fail; a plain rerun has nothing to do (a failed row is an answer); with
    --retry-failed they, and only they, are asked again, and OUTPUT is whole, in input order. The injected fault,
    the rows after the first failed one not set aside before OUTPUT is cut, loses 24 rows and fails this."""
    lines = [json.dumps({"line": n + 1}) for n in range(30)]
    source, sink = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("".join(line + "\n" for line in lines))

    def run_batch(app, **kwargs):
        return asyncio.run(batch.run(app, source, sink, 4, 8, progress=False, **kwargs))

    first = run_batch(stub_app(fail_lines={1, 7, 30}))
    assert (first.ok, first.failed) == (27, 3)
    asked: list[int] = []
    again = run_batch(stub_app(asked=asked))
    assert again.rows == 0 and asked == []
    retried = run_batch(stub_app(asked=asked), retry_failed=True)
    assert sorted(asked) == [1, 7, 30], asked
    assert (retried.retried, retried.ok, retried.failed, retried.restored) == (3, 30, 0, 27), retried.describe()
    out = [json.loads(line) for line in sink.read_text().splitlines()]
    assert [o["line"] for o in out] == list(range(1, 31)) and {o["status"] for o in out} == {"ok"}
    assert [o["response"]["body"]["answers"]["line"] for o in out] == list(range(1, 31))
    assert not batch.held_path(sink).exists()


def test_bad_bytes_in_a_row_are_that_rows_error_not_the_runs(decider, tmp_path):
    """A custom_id with a byte that is not UTF-8 (once a UnicodeEncodeError that ended the run), a state with
    one, a custom_id with a lone surrogate escape (legal JSON): each its row's answer or refusal, the rows
    around them answered, and a rerun finds OUTPUT continues INPUT (nothing to do)."""
    good = noul_rows(3, model="clef-flash")
    body = json.loads(good[0])
    lines = [
        good[0].encode(),
        json.dumps({"custom_id": "fine", "body": body}).encode(),
        b'{"custom_id": "t-\xff\xfe", "body": ' + good[1].encode() + b"}",
        good[1].replace("ticket", "ticket \xe9").encode("latin-1"),  # a state in Latin-1: not UTF-8
        json.dumps({"custom_id": "\udc80-escaped", "body": body}).encode(),
        good[2].encode(),
    ]
    source, sink = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_bytes(b"".join(line + b"\n" for line in lines))
    summary = asyncio.run(batch.run(make_app(decider), source, sink, 4, 8, progress=False))
    out = [json.loads(line) for line in sink.read_bytes().decode("utf-8").splitlines()]
    assert [o["line"] for o in out] == [1, 2, 3, 4, 5, 6] and summary.failed == 0, summary.describe()
    assert [o["status"] for o in out] == ["ok", "ok", "refused", "refused", "ok", "ok"], [o["error"] for o in out]
    assert out[2]["custom_id"] == "t-\ufffd\ufffd" and out[2]["response"]["status_code"] == 400
    assert "line 3 is not UTF-8 (byte 18: ff)" in out[2]["error"]["message"]
    assert out[3]["response"]["status_code"] == 422 and "UTF-8" in out[3]["error"]["message"]  # the server's
    assert out[4]["custom_id"] == "\udc80-escaped"
    again = asyncio.run(batch.run(make_app(decider), source, sink, 4, 8, progress=False))
    assert (again.rows, again.resumed) == (0, 6)


def test_an_output_of_another_input_with_the_same_layout_is_refused(tmp_path, capsys, cli_logging):
    """OUTPUT written for A (plain bodies: no custom_id); B has as many rows at the same lines, other states:
    refused before the model loads, one line naming both files, exit 2, OUTPUT untouched. A's own OUTPUT,
    and A with a row appended, continue. The old check (line numbers and custom_ids only) accepted B."""
    a, b, sink = tmp_path / "a.jsonl", tmp_path / "b.jsonl", tmp_path / "out.jsonl"
    rows_a, rows_b = noul_rows(3), noul_rows(3, tag="other ")
    a.write_text("".join(line + "\n" for line in rows_a))
    b.write_text("".join(line + "\n" for line in rows_b))
    answer = {"model": "clef-tiny", "answers": {}, "usage": {"input_tokens": 1}}
    records = [batch.record(batch.parse_row(n, line.encode()), 200, answer, None) for n, line in enumerate(rows_a, 1)]
    sink.write_text("".join(json.dumps(r) + "\n" for r in records))
    written = sink.read_bytes()
    assert batch.resume_point(a, sink) == (3, 3, 0)
    with pytest.raises(SystemExit) as exited:
        main(["batch", str(b), str(sink)])
    message = capsys.readouterr().err
    assert exited.value.code == 2 and message.count("\n") == 1, message
    assert f"OUTPUT {sink} does not continue INPUT {b}" in message and "line 1" in message
    assert sink.read_bytes() == written
    with open(a, "a") as more:
        more.write(rows_b[0] + "\n")
    assert batch.resume_point(a, sink) == (3, 3, 0)
