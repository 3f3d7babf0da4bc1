"""The front page and the manual: README.md stays a front page (the two commands, the flags a first deployment
needs, /ready, a link per feature), every relative link in README.md, docs/, training/README.md and
benchmarks/RESULTS.md reaches a file and, where it names one, a heading there, and every flag of clef-serve (and of
clef-serve batch) is in docs/operations.md's flag table. Each check returns its problems and is shown to catch an
injected fault."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
    ROOT / "training" / "README.md",
    ROOT / "benchmarks" / "RESULTS.md",
]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FRONT_PAGE_LINES = 200


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (hyphens and underscores kept), spaces
    to hyphens."""
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    found, seen = set(), {}
    in_code = False
    for line in text.splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and (match := re.match(r"#{1,6} (.+)", line)):
            base = slug(match.group(1))
            count = seen.get(base, 0)
            found.add(base if count == 0 else f"{base}-{count}")
            seen[base] = count + 1
    return found


def link_problems(document: Path, text: str | None = None) -> list[str]:
    """Every relative link of `document` that names no file, or a heading its file lacks."""
    text = document.read_text() if text is None else text
    text_outside_code = re.sub(r"```.*?```", "", text, flags=re.S)
    problems = []
    for target in LINK.findall(text_outside_code):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto: (not checked: no network here)
            continue
        path, _, anchor = target.partition("#")
        resolved = (document.parent / path).resolve() if path else document
        if not resolved.exists():
            problems.append(f"{document.name}: {target}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved.read_text()):
            problems.append(f"{document.name}: {target}: no heading #{anchor} in {resolved.name}")
    return problems


def front_page_problems(text: str) -> list[str]:
    problems = []
    lines = text.count("\n")
    if lines > FRONT_PAGE_LINES:
        problems.append(f"README.md has {lines} lines: a front page has at most {FRONT_PAGE_LINES}")
    headings = anchors(text)
    for needed in ("serve", "test", "deploy-on-your-cards", "is-it-ready"):
        if needed not in headings:
            problems.append(f"README.md lost its heading #{needed}")
    for words in ("make serve", "make test", "--plan", "--quantize", "--tensor-parallel-size", "--api-key", "/ready"):
        if words not in text:
            problems.append(f"README.md no longer says {words!r}")
    return problems


def test_every_relative_link_reaches_its_file_and_heading():
    problems = [problem for document in DOCUMENTS for problem in link_problems(document)]
    assert not problems, "\n".join(problems)


def test_a_broken_link_or_anchor_is_caught():
    readme = ROOT / "README.md"
    text = readme.read_text()
    assert link_problems(readme, text + "\n[x](docs/nowhere.md)\n") == ["README.md: docs/nowhere.md: no such file"]
    assert link_problems(readme, text + "\n[x](docs/operations.md#no-such-heading)\n") == [
        "README.md: docs/operations.md#no-such-heading: no heading #no-such-heading in operations.md"
    ]


def test_the_readme_is_a_front_page():
    text = (ROOT / "README.md").read_text()
    assert not front_page_problems(text), front_page_problems(text)
    assert front_page_problems(text + "x\n" * FRONT_PAGE_LINES)  # the fault: the manual pasted back in
    assert front_page_problems(text.replace("## Is it ready?", "## Probes"))


def test_slugs_follow_githubs_rule():
    assert slug("Metrics to alert on (`GET /metrics`)") == "metrics-to-alert-on-get-metrics"
    assert slug("Scoring a file: `clef-serve batch`") == "scoring-a-file-clef-serve-batch"
    assert slug("Building for V100 (sm_70) and Pascal (sm_60/61)") == "building-for-v100-sm_70-and-pascal-sm_6061"


# ---- clef-serve --help: grouped as the docs are, every flag's default said ------------------------------
HELP_GROUPS = ("serving", "memory", "verification", "clients", "variants", "scale")


def help_problems(parser) -> list[str]:
    problems = []
    formatter = parser._get_formatter()
    grouped = {
        id(action)
        for group in parser._action_groups
        if group.title.split(":")[0] in HELP_GROUPS
        for action in group._group_actions
    }
    for action in parser._actions:
        if not action.option_strings or action.dest == "help":
            continue
        flag = action.option_strings[0]
        if id(action) not in grouped:
            problems.append(f"{flag}: in no group of {HELP_GROUPS}")
        if not action.help or "default" not in formatter._expand_help(action):
            problems.append(f"{flag}: its help does not say its default")
    return problems


def test_every_flag_is_in_a_group_and_says_its_default():
    from app.cli.flags import build_parser

    parser = build_parser()
    assert not help_problems(parser), help_problems(parser)
    titles = [group.title.split(":")[0] for group in parser._action_groups][2:]
    assert titles == list(HELP_GROUPS)
    broken = build_parser()
    broken.add_argument("--stray", type=int, default=3)  # the fault: a flag added outside the groups, no help
    assert help_problems(broken) == [
        "--stray: in no group of " + str(HELP_GROUPS),
        "--stray: its help does not say its default",
    ]


# Units a numeric flag's metavar may name (the help's one line has no room to spell one out).
UNITS = {"N", "TOKENS", "SECONDS", "DURATION", "BYTES", "MIB", "FRACTION", "PIXELS", "LEVELS", "RANK", "PORT", "ROWS"}


def one_line_problems(parser) -> list[str]:
    """A flag whose help wraps at the formatter's width, or a numeric one whose metavar names no unit."""
    text = parser.format_help()
    formatter = parser._get_formatter()
    problems = []
    for action in parser._actions:
        if not action.option_strings or action.dest == "help":
            continue
        flag = action.option_strings[0]
        if formatter._expand_help(action) not in text:  # wrapped: a newline and an indent inside it
            problems.append(f"{flag}: its help takes more than one line")
        if action.type is not None and action.metavar not in UNITS:
            problems.append(f"{flag}: its metavar {action.metavar!r} names no unit")
    return problems


def test_every_flag_is_one_line_that_names_its_unit():
    """clef-serve --help (and clef-serve batch's): one line a flag at 120 columns, default included, a number's
    unit in its metavar; the details are docs/operations.md's flag table."""
    from app.cli.batch import build_batch_parser
    from app.cli.flags import build_parser

    for parser in (build_parser(), build_batch_parser()):
        assert not one_line_problems(parser), one_line_problems(parser)
    broken = build_parser()
    broken.add_argument("--stray-limit", type=int, default=3, help="a limit of something, said at such length " * 3)
    assert one_line_problems(broken) == [
        "--stray-limit: its help takes more than one line",
        "--stray-limit: its metavar None names no unit",
    ]


# ---- docs/operations.md's flag table names every flag ----------------------------------------------------
OPERATIONS = ROOT / "docs" / "operations.md"


def flags_section(text: str) -> str:
    """docs/operations.md's "## Flags" section: from its heading to the next one of its level."""
    return re.search(r"^## Flags\n(.*?)(?=^## |\Z)", text, re.S | re.M).group(1)


def undocumented_flags(parser, text: str) -> list[str]:
    """Each option string of `parser` (aliases included) that `text` never names as a whole flag."""
    problems = []
    for action in parser._actions:
        if action.dest == "help":
            continue
        for flag in action.option_strings:
            if not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text):
                problems.append(f"{flag}: not in docs/operations.md")
    return problems


def test_every_flag_is_in_the_operations_guide():
    """--help has one line a flag; docs/operations.md's table says what each does. A flag added to the parser
    without its row there fails here (the batch command's own flags too)."""
    from app.cli.batch import build_batch_parser
    from app.cli.flags import build_parser

    text = flags_section(OPERATIONS.read_text())
    for parser in (build_parser(), build_batch_parser()):
        assert not undocumented_flags(parser, text), undocumented_flags(parser, text)
    broken = build_parser()
    broken.add_argument("--stray-flag", type=int, default=3, help="a flag nobody wrote down (default: 3)")
    assert undocumented_flags(broken, text) == ["--stray-flag: not in docs/operations.md"]
    prefixes = argparse.ArgumentParser()  # a flag named only as the start of a longer one is not named
    prefixes.add_argument("--adapter")
    prefixes.add_argument("--adapter-root")
    assert undocumented_flags(prefixes, "| `--adapter-root` | none |") == ["--adapter: not in docs/operations.md"]
