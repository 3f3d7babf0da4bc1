"""clef-serve: parse the flags, check everything before the load, then serve (the model loads in the background,
/ready says when it is done), or print the plan (--plan) or the self-check (--selfcheck-only) and exit.
`clef-serve batch ...` is app.cli.batch."""

from __future__ import annotations

import logging
import sys

from app.cli.checks import check_before_loading
from app.cli.engine import make_decider, make_engine, server_settings
from app.cli.flags import EXIT_USAGE, build_parser
from app.logs import configure_logging


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["batch"]:
        from app.cli.batch import batch_main

        return batch_main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.selfcheck_only and args.selfcheck == "off":
        parser.error("--selfcheck-only runs the self-check: it cannot be combined with --selfcheck off")
    configure_logging(args.log_level, args.log_format)
    log = logging.getLogger("clef_serve")
    planned, description = check_before_loading(args, parser, log)
    if planned is not None:
        return planned
    if args.selfcheck_only:
        from clef_cuda.errors import ReleaseError

        try:
            return selfcheck_only(args)
        except ReleaseError as error:  # a tensor the config check could not see: still the model's fault
            parser.exit(EXIT_USAGE, f"clef-serve: error: {error}\n")

    from app.server import DrainingServer, create_app

    settings = server_settings(args, description)
    app = create_app(
        settings, load_engine=lambda: make_engine(args, lambda *lost: app.state.lifecycle.rank_lost(*lost))
    )
    log.info("listening on %s:%d (model loading in the background; /ready says when it is done)", args.host, args.port)
    # Request bodies and the API key are never logged (no access log; errors name no body or header).
    DrainingServer.run_app(app, args.host, args.port, args.log_level, args.drain_timeout)
    return 0


def selfcheck_only(args) -> int:
    """--selfcheck-only: the report on stdout, exit 0 when every check passed, 1 otherwise."""
    from clef_cuda.verification.selfcheck import run_selfcheck

    trunk = make_decider(args).trunk
    try:
        report = run_selfcheck(trunk, block_size=args.block_size)
    finally:
        if trunk.peers is not None:  # the other ranks checked theirs (rank1.*, ...): they go now
            trunk.peers.stop()
    print(report.table())
    print(f"self-check {report.summary()}")
    return 0 if report.passed else 1
