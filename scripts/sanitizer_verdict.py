#!/usr/bin/env python3
"""The verdict on one compute-sanitizer log of scripts/gpu_sanitize_cases.py: fails on a report inside one of
our kernels (a frame in namespace clef::), on the tool's own failure, or on the checked program's; reports
that name only other kernels (cuBLAS's nvjet GEMMs, torch's elementwise kernels) are counted and shown, not
gated: on an H200 (2026-12-04) racecheck reported shared-memory hazards inside cuBLAS's sm_90 GEMMs, whose
asynchronous copies it does not model, and initcheck reported torch's kernels reading GEMM outputs it had not
seen written (a three-line probe: F.linear, then .float() of its output, is reported the same way).

    compute-sanitizer --tool racecheck --show-backtrace no --print-limit 100000 python \\
        scripts/gpu_sanitize_cases.py --ops-only > log 2>&1; python scripts/sanitizer_verdict.py log $?

Exit 0: no report in our kernels and both the tool and the program ended well; 1: otherwise (it says why).
"""

from __future__ import annotations

import re
import sys
from collections import Counter
from pathlib import Path

PREFIX = "========="
# The first line of a report (memcheck, initcheck, racecheck, synccheck); what follows up to a bare prefix line
# (or the next report) belongs to it.
REPORT_START = re.compile(
    r"^=+ (Invalid |Uninitialized |Error: Race reported|Error: .*[Bb]arrier|Barrier error|Program hit|"
    r"Malloc/Free error|Address |Out-of-range|Misaligned|Warning: Race reported)"
)
TOOL_FAILURE = re.compile(r"Internal Sanitizer Error|Target application terminated before")
KERNEL_NAME = re.compile(r"(?:at|Device Frame:)\s+(?:void\s+|float\s+)?([A-Za-z_][\w:]*)")


def reports(lines: list[str]) -> list[list[str]]:
    found: list[list[str]] = []
    current: list[str] | None = None
    for line in lines:
        if REPORT_START.match(line):
            current = [line]
            found.append(current)
        elif current is not None and line.startswith(PREFIX):
            if line.strip() == PREFIX:
                current = None
            else:
                current.append(line)
        else:
            current = None
    return found


def kernels_of(report: list[str]) -> list[str]:
    return [m.group(1) for line in report for m in [KERNEL_NAME.search(line)] if m]


def verdict(text: str, exit_status: int) -> tuple[bool, list[str]]:
    lines = text.splitlines()
    ours, foreign = [], Counter()
    for report in reports(lines):
        names = kernels_of(report)
        if any(name.startswith("clef::") or "clef::" in line for name in names for line in report):
            ours.append(report)
        else:
            foreign[names[0] if names else report[0].removeprefix(PREFIX).strip()] += 1
    says = []
    for report in ours[:10]:
        says.append("OURS: " + " | ".join(line.removeprefix(PREFIX).strip() for line in report[:4]))
    passed = not ours
    for name, count in foreign.most_common():
        says.append(f"not ours, not gated: {count} report(s) in {name}")
    if any(TOOL_FAILURE.search(line) for line in lines):
        passed = False
        says.append("the sanitizer itself failed (an internal error, or the program was killed under it)")
    if exit_status != 0:
        passed = False
        says.append(f"the checked program (or the tool) exited {exit_status}")
    counts = f"{len(ours)} report(s) in our kernels, {sum(foreign.values())} in others"
    says.append(f"{'PASS' if passed else 'FAIL'}: {counts}")
    return passed, says


def main() -> int:
    if len(sys.argv) != 3:
        print("usage: sanitizer_verdict.py LOG EXIT_STATUS", file=sys.stderr)
        return 2
    passed, says = verdict(Path(sys.argv[1]).read_text(errors="replace"), int(sys.argv[2]))
    print("\n".join(says))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
