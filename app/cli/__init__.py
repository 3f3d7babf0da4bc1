"""clef-serve's command line (docs/operations.md#flags): flags.py (the flags, no torch), engine.py (the decider and
engine they describe), plan.py (--plan), checks.py (everything before the load), serve.py (main), batch.py
(`clef-serve batch`). A bad flag or model directory is a one-line error naming it, exit code 2."""

from app.cli.serve import main

__all__ = ["main"]
