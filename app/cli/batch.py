"""clef-serve batch INPUT.jsonl OUTPUT.jsonl [the serving flags]: the command (its flags, its exit codes); the run
itself (reading, resuming, writing in order) is app.batch."""

from __future__ import annotations

import argparse
import logging
import sys

from app.cli.checks import check_before_loading
from app.cli.engine import make_engine, server_settings
from app.cli.flags import EXIT_USAGE, _positive_int, build_parser
from app.logs import configure_logging


def build_batch_parser() -> argparse.ArgumentParser:
    """clef-serve batch: the serving flags and its own group."""
    parser = build_parser(
        "clef-serve batch",
        "Score a file of System One requests (JSON lines) into OUTPUT, in input order, with the serving flags' "
        "model and engine; a rerun resumes.",
        epilog="Exit codes: 0 every row answered or refused, 1 some failed, 2 a bad flag or file, 130 interrupted.",
    )
    batch_flags = parser.add_argument_group("batch: the files and how the engine is fed (docs/clients.md)")
    batch_flags.add_argument(
        "input",
        metavar="INPUT.jsonl",
        help="one request a line: a System One body or "
        '{"custom_id", "method", "url", "body"} (the OpenAI / vLLM batch form)',
    )
    batch_flags.add_argument("output", metavar="OUTPUT.jsonl", help="one record a line, in input order; appended to")
    batch_flags.add_argument(
        "--max-in-flight",
        type=_positive_int,
        metavar="ROWS",
        help="submitted at once (default: 4 x --max-num-seqs)",
    )
    batch_flags.add_argument(
        "--read-ahead",
        type=_positive_int,
        default=1024,
        metavar="ROWS",
        help="read ahead of the last written; a state's rows group in it",
    )
    batch_flags.add_argument(
        "--no-progress", action="store_true", help="no progress bar (the summary is still printed)"
    )
    batch_flags.add_argument(
        "--retry-failed",
        action="store_true",
        help="resuming, ask the rows OUTPUT records as failed again",
    )
    return parser


def batch_main(argv: list[str]) -> int:
    """clef-serve batch INPUT.jsonl OUTPUT.jsonl [the serving flags]: app/batch.py."""
    import asyncio

    from app import batch as runner

    parser = build_batch_parser()
    args = parser.parse_args(argv)
    configure_logging(args.log_level, args.log_format)
    log = logging.getLogger("clef_serve")
    if args.log_level != "debug":  # a line per row would bury the progress bar: the summary counts them
        logging.getLogger("clef_serve.requests").setLevel(logging.WARNING)
        logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        source, sink = runner.check_paths(args.input, args.output)
        runner.resume_point(source, sink)  # another file's OUTPUT is refused before the model loads
    except runner.BatchFileError as error:
        parser.exit(EXIT_USAGE, f"{parser.prog}: error: {error}\n")
    planned, description = check_before_loading(args, parser, log)
    if planned is not None:
        return planned
    from app.server import create_app
    from clef_cuda.errors import ReleaseError

    try:
        engine = make_engine(args)
    except ReleaseError as error:
        parser.exit(EXIT_USAGE, f"{parser.prog}: error: {error}\n")
    app = create_app(server_settings(args, description), engine=engine)
    in_flight = args.max_in_flight or 4 * args.max_num_seqs
    try:
        summary = asyncio.run(
            runner.run(
                app,
                source,
                sink,
                in_flight,
                max(args.read_ahead, in_flight),
                not args.no_progress,
                log,
                retry_failed=args.retry_failed,
            )
        )
    except RuntimeError as error:  # the model never became ready (a failed self-check, a lost rank)
        print(f"{parser.prog}: {error}", file=sys.stderr)
        return runner.EXIT_FAILED
    except KeyboardInterrupt:  # the second Ctrl-C: OUTPUT holds every row written so far, whole
        print(f"{parser.prog}: stopped; rerun the same command to resume", file=sys.stderr)
        return runner.EXIT_INTERRUPTED
    print(summary.describe(), file=sys.stderr)
    if summary.stopped is not None:  # the rows from stopped_at on are unwritten: the rerun asks them
        print(
            f"{parser.prog}: stopped: the server refuses to answer (lines from {summary.stopped_at} on not written): "
            f"{summary.stopped}",
            file=sys.stderr,
        )
        return runner.EXIT_FAILED
    if summary.interrupted:
        return runner.EXIT_INTERRUPTED
    return runner.EXIT_FAILED if summary.failed else 0
