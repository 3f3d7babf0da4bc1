"""Compare two serving configurations on your own requests before deploying one: e.g. int8 weights
against the f32 (or f16) model.

    python -m clef_cuda.compare --w /mnt/models/clef-flash --requests requests.jsonl --a f16 --b int8 [--d 0]

`--requests` holds one System One request body per line (what clients POST to /v1/systemone). Each
configuration is loaded, answers every request and is freed before the next one loads, so peak memory is
the larger of the two, not both. A configuration is a dtype (`f32`, `f16`, `bf16`) or `int8` (int8
weights, activations in the device's default dtype: f16 on a GPU, f32 on the CPU), or `int8-f16`,
`int8-bf16`, `int8-f32`. It prints, over every answered question: the largest difference of any option's
probability, how often the rounded answers (what the API returns) are identical, and how often the top
option agrees, per question type. Bad input is a one-line error naming the file, line or flag, exit 2.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DTYPES = {"f32": "float32", "f16": "float16", "bf16": "bfloat16"}
EXIT_USAGE = 2


@dataclass(frozen=True)
class Configuration:
    name: str
    dtype: str | None  # torch dtype name; None: the device's default
    quantize: str  # "none" | "int8"


def parse_configuration(text: str) -> Configuration:
    """'f32' | 'f16' | 'bf16' | 'int8' | 'int8-<dtype>' -> Configuration; ValueError naming the text."""
    kind, _, dtype = text.strip().lower().partition("-")
    if kind in DTYPES and not dtype:
        return Configuration(text, DTYPES[kind], "none")
    if kind == "int8" and (not dtype or dtype in DTYPES):
        return Configuration(text, DTYPES.get(dtype), "int8")
    raise ValueError(f"{text!r} is not a configuration (f32, f16, bf16, int8, int8-f16, int8-bf16, int8-f32)")


def read_requests(path: Path) -> list[dict[str, Any]]:
    """One request body per non-blank line; ValueError naming the file and line."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"{path}: cannot be read ({error})") from None
    requests = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            request = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}:{number}: not JSON ({error.msg})") from None
        if not isinstance(request, dict) or not isinstance(request.get("questions"), dict):
            raise ValueError(f"{path}:{number}: not a System One request (an object with 'questions')")
        requests.append(request)
    if not requests:
        raise ValueError(f"{path}: no requests")
    return requests


@dataclass
class Run:
    """One configuration's answers: per request, per question (id, type, unrounded probabilities by
    option, the rounded answer)."""

    configuration: Configuration
    load_seconds: float
    decide_seconds: float
    questions: list[list[tuple[str, str, dict[str, float], dict]]] = field(default_factory=list)


def run_configuration(release: str, device: str | None, configuration: Configuration, requests) -> Run:
    """Load `release` as `configuration`, answer every request, free it again."""
    import torch

    from clef_cuda.decider import Decider
    from clef_cuda.request import answers

    started = time.perf_counter()
    dtype = getattr(torch, configuration.dtype) if configuration.dtype else None
    decider = Decider.from_release(release, device=device, dtype=dtype, quantize=configuration.quantize, progress=False)
    run = Run(configuration, time.perf_counter() - started, 0.0)
    started = time.perf_counter()
    for index, request in enumerate(requests):
        try:
            images = decider.prepare_images(_request_images(request, decider))
            record = decider.encode(request, images)
            probabilities = decider.probabilities(record, features=decider.image_features(images))
        except Exception as error:  # a request the server would refuse: say which
            raise ValueError(f"request {index + 1}: {type(error).__name__}: {error}") from None
        per_question = []
        for question, p in zip(record.questions, probabilities, strict=True):
            spec = request["questions"][question.question_id]
            by_option = dict(zip(question.option_ids, p, strict=True))
            answer = answers.answer(spec, by_option, decider.options.confidence)
            per_question.append((question.question_id, spec["type"], by_option, answer))
        run.questions.append(per_question)
    run.decide_seconds = time.perf_counter() - started
    del decider
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return run


def _request_images(request, decider):
    from clef_cuda.request.images import request_images

    return request_images(request, decider.options.image_limits)


@dataclass
class Comparison:
    questions: int = 0
    max_abs_dp: float = 0.0
    rounded_equal: int = 0
    argmax_equal: dict[str, list[int]] = field(default_factory=dict)  # type -> [agree, asked]
    max_abs_dp_by_type: dict[str, float] = field(default_factory=dict)


def compare(a: Run, b: Run) -> Comparison:
    result = Comparison()
    for qa, qb in zip(a.questions, b.questions, strict=True):
        for (qid, kind, pa, answer_a), (qid_b, _, pb, answer_b) in zip(qa, qb, strict=True):
            assert qid == qid_b
            worst = max(abs(pa[o] - pb[o]) for o in pa)
            result.questions += 1
            result.max_abs_dp = max(result.max_abs_dp, worst)
            result.max_abs_dp_by_type[kind] = max(result.max_abs_dp_by_type.get(kind, 0.0), worst)
            result.rounded_equal += answer_a == answer_b
            agree = result.argmax_equal.setdefault(kind, [0, 0])
            agree[0] += max(pa, key=pa.get) == max(pb, key=pb.get)
            agree[1] += 1
    return result


def table(a: Run, b: Run, result: Comparison) -> str:
    lines = [
        f"{a.configuration.name} vs {b.configuration.name}: {len(a.questions)} requests, {result.questions} questions",
        f"  load: {a.load_seconds:.2f} s vs {b.load_seconds:.2f} s; answering: {a.decide_seconds:.2f} s vs "
        f"{b.decide_seconds:.2f} s",
        f"  max |dp| over every option:        {result.max_abs_dp:.2e}",
        f"  rounded answers identical:        {result.rounded_equal}/{result.questions} "
        f"({100 * result.rounded_equal / max(result.questions, 1):.1f}%)",
        f"  {'type':8s} {'top option agrees':>20s} {'max |dp|':>10s}",
    ]
    for kind in sorted(result.argmax_equal):
        agree, asked = result.argmax_equal[kind]
        lines.append(
            f"  {kind:8s} {agree:>8d}/{asked:<5d} {100 * agree / asked:5.1f}% {result.max_abs_dp_by_type[kind]:>10.2e}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m clef_cuda.compare",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--w", "--weights", dest="weights", required=True, help="release directory")
    parser.add_argument("--requests", required=True, type=Path, help="JSONL: one System One request body per line")
    parser.add_argument("--a", default="f32", help="the reference configuration (default f32)")
    parser.add_argument("--b", default="int8", help="the configuration to check (default int8)")
    parser.add_argument("--d", "--device", dest="device", help="GPU index, cuda:N or cpu (default: GPU 0 if any)")
    args = parser.parse_args(argv)

    def fail(message: str) -> int:
        print(f"clef_cuda.compare: error: {message}", file=sys.stderr)
        return EXIT_USAGE

    try:
        configurations = [parse_configuration(args.a), parse_configuration(args.b)]
    except ValueError as error:
        return fail(f"--a/--b: {error}")
    if not Path(args.weights).is_dir():
        return fail(f"--w {args.weights}: not a directory (expected a clef-flash release)")
    device = f"cuda:{args.device}" if args.device and args.device.isdigit() else args.device
    from clef_cuda.errors import ReleaseError

    try:
        requests = read_requests(args.requests)
        runs = [run_configuration(args.weights, device, c, requests) for c in configurations]
    except (ValueError, ReleaseError) as error:
        return fail(str(error))
    print(table(*runs, compare(*runs)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
