#!/usr/bin/env python3
"""Applies each break of tests/breaks.py in a copy of the tree and runs the tests that must catch it: first every
named test unbroken (it must pass, or the breaks prove nothing), then each break (its tests must fail). Prints a
table, and exits 1 if a break went uncaught or a test failed unbroken.

    python scripts/show_breaks.py                  # every break (the live alert scenarios: minutes each)
    python scripts/show_breaks.py --group lifecycle
    python scripts/show_breaks.py --name "ClefNotReady on a value never exported"
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from breaks import BREAKS, Tree  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    groups = sorted({b.group for b in BREAKS})
    parser.add_argument("--group", choices=groups, action="append", help="only these groups (default: all)")
    parser.add_argument("--name", action="append", help="only the breaks of these names")
    parser.add_argument("--timeout", type=float, default=900, metavar="SECONDS", help="one pytest run at most")
    args = parser.parse_args(argv)
    chosen = [b for b in BREAKS if (not args.group or b.group in args.group) and (not args.name or b.name in args.name)]
    if not chosen:
        parser.exit(2, "show_breaks.py: no break of that group or name\n")
    tree = Tree()
    rows, failed = [], False
    try:
        if not tree.imports_its_own_package():
            parser.exit(2, "show_breaks.py: the copy's Python imports the installed package, not the copy\n")
        for tests in dict.fromkeys(b.tests for b in chosen):
            healthy = tree.run(tests, timeout=args.timeout)
            rows.append(("(unbroken)", " ".join(t.split("::")[-1] for t in tests), healthy.exit_code == 0, healthy))
            failed |= healthy.exit_code != 0
            print(f"unbroken {tests}: exit {healthy.exit_code} in {healthy.seconds:.0f} s", flush=True)
        for brk in chosen:
            outcome = tree.run(brk.tests, brk, timeout=args.timeout)
            rows.append((brk.name, " ".join(t.split("::")[-1] for t in brk.tests), outcome.caught, outcome))
            failed |= not outcome.caught
            print(f"{brk.name}: {'caught' if outcome.caught else 'MISSED'} in {outcome.seconds:.0f} s", flush=True)
    finally:
        tree.close()
    print("\n| break | tests | as they must | pytest's exit | seconds |")
    print("|---|---|---|---|---|")
    for name, tests, good, outcome in rows:
        verdict = ("pass" if name == "(unbroken)" else "fail") if good else "NO"
        print(f"| {name} | {tests} | {verdict} | {outcome.exit_code} | {outcome.seconds:.0f} |")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
