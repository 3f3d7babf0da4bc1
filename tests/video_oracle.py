"""Cloudflare's reference answering requests with videos, run by the video oracle's own interpreter
(.venv-video-oracle: torchcodec alone, beside the test venv's packages through a .pth line; make test's set-up builds
it). transformers decodes videos only with torchcodec, and torchcodec must stay out of the test venv (it would change
how the reference decodes images), so the reference's video path runs in this second process.

    LD_LIBRARY_PATH=$(python -c 'import video_oracle as o; print(o.ffmpeg_library_path())') \
        .venv-video-oracle/bin/python tests/video_oracle.py RELEASE [DUMP_DIR] < requests.jsonl > answers.jsonl

(tests/test_videos.py's run_oracle does this.) torchcodec decodes with the FFmpeg our server decodes with, PyAV's own
(ffmpeg_library_path): FFmpeg versions demux some files differently (5.1 and 8.1 give a B-frame MP4 with a variable
frame rate different lengths, so different sampled frames), and the comparison is of the reference's code with ours,
not of two FFmpegs.

Each request line is a System One body whose `videos` are file paths (what the reference's processor opens); each
answer line is {"response", "unrounded": {question: {option: p}}, "input_ids"} or {"error": "..."}. With DUMP_DIR,
line n's processor outputs (pixel_values_videos, video_grid_thw, and the images' if any) and the M-RoPE positions of
get_rope_index go to DUMP_DIR/n.pt."""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
ROOT = Path(__file__).resolve().parents[1]
ORACLE_VENV = ROOT / ".venv-video-oracle"


def ffmpeg_library_path() -> str:
    """An LD_LIBRARY_PATH under which torchcodec loads PyAV's FFmpeg: links by the sonames torchcodec's build for that
    FFmpeg major links against (libavformat.so.62, ...) to PyAV's bundled libraries (libavformat-4639def2.so.62...),
    and PyAV's library folder for their own dependencies. Run in the test venv (it imports av)."""
    import av

    libs = Path(av.__file__).resolve().parent.parent / "av.libs"
    links = ORACLE_VENV / "ffmpeg"
    links.mkdir(parents=True, exist_ok=True)
    for library in libs.glob("lib*.so.*"):
        match = re.fullmatch(r"(lib(?:av[a-z]+|sw[a-z]+))-[0-9a-f]+\.so\.(\d+)[.\d]*", library.name)
        link = links / f"{match[1]}.so.{match[2]}" if match else None
        if link is not None and link.resolve() != library:  # new, or left by another PyAV's build
            temporary = links / f".{link.name}.{os.getpid()}"
            temporary.unlink(missing_ok=True)
            temporary.symlink_to(library)
            os.replace(temporary, link)  # atomic: another test worker may be reading the folder
    return f"{links}:{libs}"


def container_of(blob: bytes) -> str:
    return "webm" if blob[:4] == b"\x1a\x45\xdf\xa3" else "mp4"


def data_url(blob: bytes) -> str:
    return f"data:video/{container_of(blob)};base64," + base64.b64encode(blob).decode()


# ---- the test venv's side -------------------------------------------------------------------------
def run(release: Path, requests: list[dict], workdir: Path, dump: bool = False) -> list[dict]:
    """The reference's answers to `requests` (their `videos` as bytes: written to files for its processor)."""
    import pytest

    python = ORACLE_VENV / "bin" / "python"
    if not python.exists():
        pytest.fail(f"{python} is missing: `bash scripts/setup_env.sh test` builds the video oracle's venv")
    lines = []
    for n, request in enumerate(requests):
        paths = []
        for k, blob in enumerate(request.get("videos", [])):
            path = workdir / f"{n}-{k}.{container_of(blob)}"
            path.write_bytes(blob)
            paths.append(str(path))
        lines.append(json.dumps(request | {"videos": paths}))
    dump_dir = workdir / "dump"
    dump_dir.mkdir(exist_ok=True)
    done = subprocess.run(
        [str(python), __file__, str(release), *([str(dump_dir)] if dump else [])],
        input="\n".join(lines) + "\n",
        capture_output=True,
        text=True,
        timeout=900,
        cwd=ROOT,
        env=os.environ | {"CLEF_FINETUNE_JSM": "vendored", "LD_LIBRARY_PATH": ffmpeg_library_path()},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    answers = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(answers) == len(requests), done.stderr[-3000:]
    return answers


# ---- the oracle venv's side ------------------------------------------------------------------------
def main() -> int:
    import av
    import torch
    import torchcodec._core  # the reference's video decoder: fail here, clearly, when it is missing
    from parity import reference_response

    theirs, ours = torchcodec._core.get_ffmpeg_library_versions(), av.library_versions
    if tuple(theirs["libavformat"]) != tuple(ours["libavformat"]):
        sys.exit(f"torchcodec loaded FFmpeg {theirs['ffmpeg_version']}, not PyAV's: set LD_LIBRARY_PATH as above")

    from clef_finetune.jsm import load_jsm

    jsm = load_jsm()
    model, processor = jsm.load_release_model(sys.argv[1], device="cpu", dtype=torch.float32)
    if len(sys.argv) > 3 and sys.argv[2] == "--time":  # benchmarks/video_latency.py's reference
        return _time(jsm, model, processor, int(sys.argv[3]))
    dump = Path(sys.argv[2]) if len(sys.argv) > 2 else None
    for number, line in enumerate(sys.stdin):
        request = json.loads(line)
        try:
            response, unrounded = reference_response((jsm, model, processor), request)
            record = jsm.encode_record(processor.tokenizer, request, processor=processor)
            answer = {"response": response, "unrounded": unrounded, "input_ids": list(record.input_ids)}
            if dump is not None:
                _dump(jsm, model, processor, record, dump / f"{number}.pt")
        except Exception as error:  # noqa: BLE001  (the test reads what the reference refused)
            answer = {"error": f"{type(error).__name__}: {error}"}
        print(json.dumps(answer), flush=True)
    return 0


def _time(jsm, model, processor, repeats: int) -> int:
    """Each request's median seconds over `repeats` (after one warm run): encode_record (torchcodec's decoding and
    the processor's preprocessing), the tower on its frames, and the whole systemone; printed as a JSON line."""
    import statistics
    import time

    import torch

    torch.set_num_threads(int(os.environ.get("CLEF_BENCH_THREADS", torch.get_num_threads())))

    def median(fn) -> float:
        fn()
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            fn()
            times.append(time.perf_counter() - started)
        return statistics.median(times)

    for line in sys.stdin:
        request = json.loads(line)
        record = jsm.encode_record(processor.tokenizer, request, processor=processor)
        media = record.media
        with torch.inference_mode():
            tower = median(
                lambda m=media: model.language_model.model.get_video_features(
                    m["pixel_values_videos"], torch.as_tensor(m["video_grid_thw"])
                )
            )
            timing = {
                "encode": median(lambda r=request: jsm.encode_record(processor.tokenizer, r, processor=processor)),
                "tower": tower,
                "total": median(lambda r=request: jsm.systemone(model, processor, r)),
                "tokens": len(record.input_ids),
            }
        print(json.dumps(timing), flush=True)
    return 0


def _dump(jsm, model, processor, record, path: Path) -> None:
    import torch

    batch = jsm.collate_records([record], processor.tokenizer.pad_token_id, torch.device("cpu"))
    media = batch["media"]
    with torch.inference_mode():
        positions, _ = model.language_model.model.get_rope_index(
            batch["input_ids"],
            media["mm_token_type_ids"],
            image_grid_thw=media.get("image_grid_thw"),
            video_grid_thw=media.get("video_grid_thw"),
        )
    keep = ("pixel_values_videos", "video_grid_thw", "pixel_values", "image_grid_thw")
    torch.save({key: media[key] for key in keep if key in media} | {"positions": positions[:, 0]}, path)


if __name__ == "__main__":
    sys.exit(main())
