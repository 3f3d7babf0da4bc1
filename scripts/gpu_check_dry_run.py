#!/usr/bin/env python3
"""scripts/gpu_check.sh --dry-run: what can be known of the GPU check without a GPU, so that the one short
window a lent GPU gives is not lost to an import error or a test the gate does not select. CI runs it.
Installs nothing; exits 1 naming every problem:

1. Every module the check imports resolves on the GPU machine: the Python files gpu_check.sh runs (its
   tests, benchmarks and scripts, conftest.py, and every local module they import, at any depth, function-
   level imports included; an import guarded by `except ImportError` is optional) import only the standard
   library, this repository, and distributions listed in scripts/gpu_image_packages.txt (the machine's
   image) or scripts/gpu_check_requirements.txt (the wheels carried to it). A module is mapped to its
   distribution through this environment's installed metadata, so it must be installed here too.
2. Every carried wheel's own requirements are in one of the two lists (they are installed --no-deps).
3. Each GPU test the gate names is collected by its selection (`pytest --collect-only -m cuda` over the
   gate's files with CLEF_ASSUME_CUDA=1, which makes the cuda backend appear without a GPU): every file
   contributes cases, and the GPU-only tests below are among them.

    python scripts/gpu_check_dry_run.py [--image FILE] [--wheels FILE]
"""

from __future__ import annotations

import argparse
import ast
import importlib.metadata as metadata
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
LOCAL_ROOTS = (ROOT, ROOT / "tests", ROOT / "benchmarks", ROOT / "scripts", ROOT / "tests" / "cuda_sim")
LOCAL_PACKAGES = {"clef_cuda", "app", "training"}
# GPU-only tests (no CPU twin) the gate must select, by test function name.
REQUIRED_GPU_TESTS = (
    "test_wmma2_matches_reference_on_the_gpu",
    "test_the_server_starts_on_the_gpu_after_its_kernel_trials",
)


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


NO_DEPS_MARK = "# no-deps:"  # a carried wheel whose own requirements are not needed, with the reason


def read_list(path: Path, no_deps: set[str] | None = None) -> dict[str, str | None]:
    """name -> pinned version (None: unpinned) of a requirements-style list; names marked NO_DEPS_MARK go to
    `no_deps`."""
    found = {}
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if no_deps is not None and NO_DEPS_MARK in raw:
            no_deps.add(normalize(re.match(r"[A-Za-z0-9._-]+", line).group(0)))
        match = re.match(r"([A-Za-z0-9][A-Za-z0-9._-]*)(\[[^\]]*\])?\s*(==\s*([^\s;]+))?", line)
        if match:
            found[normalize(match.group(1))] = match.group(4)
    return found


def gate_test_files(script: str) -> list[Path]:
    match = re.search(r'GATE_TESTS="([^"]+)"', script)
    if not match:
        raise SystemExit("gpu_check_dry_run: gpu_check.sh has no GATE_TESTS list")
    return [ROOT / p for p in match.group(1).replace("\\\n", " ").split()]


def entry_points(script: str) -> list[Path]:
    """The Python files gpu_check.sh runs or hands to pytest, and the tests' conftest."""
    files = {ROOT / m for m in re.findall(r"\b((?:tests|benchmarks|scripts)/[\w/]+\.py)\b", script)}
    files |= set(gate_test_files(script)) | {ROOT / "tests" / "conftest.py"}
    return sorted(f for f in files if f.name != Path(__file__).name)


def _optional(node: ast.AST, parents: dict) -> bool:
    """An import inside `try: ... except ImportError` (ModuleNotFoundError, Exception: what it guards is
    optional), or under `if TYPE_CHECKING:`."""
    while node in parents:
        parent = parents[node]
        if isinstance(parent, ast.Try) and node in parent.body:
            for handler in parent.handlers:
                names = [handler.type] if not isinstance(handler.type, ast.Tuple) else list(handler.type.elts)
                guards = ("ImportError", "ModuleNotFoundError", "Exception", "BaseException")
                if any(isinstance(n, ast.Name) and n.id in guards for n in names):
                    return True
        if isinstance(parent, ast.If) and "TYPE_CHECKING" in ast.unparse(parent.test):
            return True
        node = parent
    return False


def imports_of(path: Path) -> tuple[set[str], set[str]]:
    """(modules imported, not optionally; .py file names mentioned in string constants: loaded by path)."""
    tree = ast.parse(path.read_text(), str(path))
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    modules, by_path = set(), set()
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and not _optional(node, parents):
            modules |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and not _optional(node, parents):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                modules.add(".".join([*base, node.module] if node.module else base))
            else:
                modules.add(node.module)
                modules |= {f"{node.module}.{alias.name}" for alias in node.names}
        elif (
            isinstance(node, ast.Constant) and isinstance(node.value, str) and re.fullmatch(r"[\w.-]+\.py", node.value)
        ):
            by_path.add(node.value)
    return modules, by_path


def local_file(module: str) -> Path | None:
    parts = module.split(".")
    for root in LOCAL_ROOTS:
        for candidate in (root.joinpath(*parts).with_suffix(".py"), root.joinpath(*parts, "__init__.py")):
            if candidate.is_file():
                return candidate
    return None


def by_path_file(name: str) -> Path | None:
    for root in LOCAL_ROOTS[1:]:
        if (root / name).is_file():
            return root / name
    return None


def closure(entries: list[Path]) -> dict[str, set[Path]]:
    """External top-level module -> the local files that import it."""
    external: dict[str, set[Path]] = {}
    seen, todo = set(), list(entries)
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        modules, by_path = imports_of(path)
        for module in modules:
            local = local_file(module)
            if local is not None:
                todo.append(local)
                continue
            top = module.split(".")[0]
            if top in LOCAL_PACKAGES or top == "__future__" or local_file(top) is not None:
                continue  # a name inside a local module (from x import y), or the compiled extension
            external.setdefault(top, set()).add(path)
        todo += [f for f in (by_path_file(n) for n in by_path) if f is not None]
    return external


def check_modules(external: dict[str, set[Path]], available: set[str]) -> list[str]:
    problems = []
    owners = metadata.packages_distributions()
    for module, users in sorted(external.items()):
        if module in sys.stdlib_module_names:
            continue
        dists = {normalize(d) for d in owners.get(module, [])}
        where = ", ".join(sorted(str(u.relative_to(ROOT)) for u in users)[:3])
        if not dists:
            problems.append(
                f"module {module} (imported by {where}) is not installed here, so its distribution is unknown"
            )
        elif not dists & available:
            problems.append(
                f"module {module} (distribution {', '.join(sorted(dists))}, imported by {where}) is neither in "
                "the GPU image (scripts/gpu_image_packages.txt) nor in the carried wheels "
                "(scripts/gpu_check_requirements.txt)"
            )
    return problems


def check_wheel_requirements(
    wheels: dict[str, str | None], versions: dict[str, str | None], no_deps: set[str]
) -> list[str]:
    """Each carried wheel's requirements present, at a version its specifier admits where the version is known
    (`versions`: both lists, the wheels' pins over the image's)."""
    from packaging.requirements import Requirement

    problems = []
    for wheel in wheels:
        if wheel in no_deps:
            continue
        try:
            requires = metadata.requires(wheel) or []
        except metadata.PackageNotFoundError:
            problems.append(f"carried wheel {wheel} is not installed here: its requirements cannot be checked")
            continue
        for requirement in requires:
            if "extra ==" in requirement:
                continue
            if "python_version" in requirement and "<" in requirement.split(";", 1)[1]:
                continue  # a backport for older Pythons (the machine runs 3.12)
            parsed = Requirement(requirement)
            name = normalize(parsed.name)
            if name not in versions:
                problems.append(f"carried wheel {wheel} needs {name}, in neither list ({requirement})")
            elif versions[name] is not None and not parsed.specifier.contains(versions[name], prereleases=True):
                problems.append(
                    f"carried wheel {wheel} needs {requirement}; the machine would have {name} {versions[name]}"
                )
    return problems


def check_collection(script: str) -> list[str]:
    files = gate_test_files(script)
    env = os.environ | {"CLEF_ASSUME_CUDA": "1"}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "--collect-only",
            "-q",
            "-p",
            "no:cacheprovider",
            "-m",
            "cuda",
            *map(str, files),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
    )
    ids = [line for line in result.stdout.splitlines() if "::" in line]
    problems = [] if result.returncode == 0 else [f"collecting the gate's tests failed:\n{result.stdout[-2000:]}"]
    for f in files:
        count = sum(1 for i in ids if i.startswith(str(f.relative_to(ROOT))))
        if count == 0:
            problems.append(f"the gate selects no GPU case of {f.relative_to(ROOT)} (-m cuda)")
    for name in REQUIRED_GPU_TESTS:
        if not any(f"::{name}" in i for i in ids):
            problems.append(f"the gate does not select the GPU-only test {name}")
    print(f"gpu_check dry run: the gate selects {len(ids)} GPU cases over {len(files)} files")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--image", default=str(ROOT / "scripts" / "gpu_image_packages.txt"))
    parser.add_argument("--wheels", default=str(ROOT / "scripts" / "gpu_check_requirements.txt"))
    parser.add_argument("--no-collect", action="store_true", help="skip the pytest collection (tests of this script)")
    args = parser.parse_args()
    script = SCRIPT.read_text()
    no_deps: set[str] = set()
    image, wheels = read_list(Path(args.image)), read_list(Path(args.wheels), no_deps)
    available = set(image) | set(wheels)
    entries = entry_points(script)
    external = closure(entries)
    problems = check_modules(external, available) + check_wheel_requirements(wheels, image | wheels, no_deps)
    print(
        f"gpu_check dry run: {len(entries)} entry files, {len(external)} external modules, "
        f"{len(image)} image packages, {len(wheels)} carried wheels"
    )
    if not args.no_collect:
        problems += check_collection(script)
    for problem in problems:
        print(f"FAIL {problem}")
    print("gpu_check dry run: " + ("passed" if not problems else f"{len(problems)} problem(s)"))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
