#!/usr/bin/env python3
"""Ours against llama.cpp (the engine under ollama) on the CPU, on the same weights: a 2,048-token prefill of a
random release at the "mid" shape (benchmarks/decision_latency.py's) and at hidden 2048, 8 layers; ours in f32,
bf16 and int8, llama.cpp in f32, f16, bf16 and Q8_0 from its own converter; 1 and 2 threads, interleaved repeats,
medians, every time against llama.cpp's fastest; and each engine's last-token logits against transformers' (f32).

    python benchmarks/cpu_peers.py --llama-cpp-src DIR [--markdown benchmarks/RESULTS.md]
    CLEF_CPU_ISA=avx2 python benchmarks/cpu_peers.py --llama-cpp-src DIR --llama-cpp-lib AVX2_BUILD/bin
        # an AVX2-only comparison on an AVX-512 machine: our kernels and torch's GEMMs pinned to AVX2, and a
        # llama.cpp built without AVX-512 (CLEF_CPU_ISA does not reach llama.cpp; the title prints what its
        # build uses, from llama_print_system_info)

llama.cpp is an optional benchmark dependency, never a test or runtime one:
    pip install llama-cpp-python==0.3.36          # builds llama.cpp for this CPU (-march=native), ~15 min on 2 cores
    pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 && tar xzf llama_cpp_python-0.3.36.tar.gz
    DIR = llama_cpp_python-0.3.36/vendor/llama.cpp   (convert_hf_to_gguf.py and gguf-py, the same version)
The converter identifies a BPE tokenizer by hashing its output on a fixed text; our test releases' tokenizer is
a small one trained here, which it does not know, so it is told "qwen2" (the pre-tokenizer Qwen's releases
use). The measurement feeds token ids to both engines: the tokenizer plays no part in it.

What is timed: ours, the trunk's prefill of the 2,048 ids as one chunk (Trunk.forward, the kernels the
start-up autotune chooses) and the last token's logits over the whole vocabulary; llama.cpp, Llama.eval of the
same ids in one batch (n_batch = n_ubatch = 2,048), which computes the last token's logits. Neither includes
loading. A missing llama_cpp package or converter is a one-line error, exit 2 (--ours-only runs ours alone).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import importlib.util
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from releases import build_release  # noqa: E402  (tests/ is on the path only now)

_spec = importlib.util.spec_from_file_location("decision_latency", ROOT / "benchmarks" / "decision_latency.py")
decision_latency = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(decision_latency)

MID = decision_latency.RELEASES["mid"]
SHAPES = {
    "mid": MID,
    "hidden-2048": dict(
        text=dict(
            MID["text"],
            hidden_size=2048,
            intermediate_size=6144,
            num_attention_heads=16,
            num_key_value_heads=4,
            linear_num_key_heads=16,
            linear_num_value_heads=32,
        ),
        head=dict(MID["head"], hidden_size=2048),
        vocab_size=MID["vocab_size"],
    ),
}
BLOCK = 16

# Run by a child python: the converter with the pre-tokenizer check answered (see the module docstring).
CONVERT = """
import runpy, sys
src = sys.argv[1]
sys.path[:0] = [src, src + "/gguf-py"]
import conversion.base
conversion.base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"
sys.argv = [src + "/convert_hf_to_gguf.py"] + sys.argv[2:]
runpy.run_path(src + "/convert_hf_to_gguf.py", run_name="__main__")
"""


def convert(src: Path, release: Path, outtype: str, out: Path) -> Path:
    # --no-mtp: our test releases carry no multi-token-prediction tensors (a decision never runs a Clef release's).
    args = [str(src), str(release), "--outtype", outtype, "--outfile", str(out), "--no-mtp"]
    result = subprocess.run(
        [sys.executable, "-c", CONVERT, *args],
        capture_output=True,
        text=True,
    )
    if result.returncode != 0:
        raise RuntimeError(f"llama.cpp's converter failed on {release} ({outtype}):\n{result.stderr[-3000:]}")
    return out


def reference_logits(release: Path, ids: list[int]) -> torch.Tensor:
    """transformers' last-token logits in f32: the truth every engine is compared with."""
    from transformers import Qwen3_5ForConditionalGeneration

    model = Qwen3_5ForConditionalGeneration.from_pretrained(release, dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([ids])).logits[0, -1].float()
    del model
    gc.collect()
    return logits


class Ours:
    """Our trunk on one release in one dtype (int8: int8 weights, activations in `dtype`), autotuned as clef-serve
    is at start-up."""

    def __init__(self, release: Path, dtype: torch.dtype, quantize: str, tokens: int, autotune: str) -> None:
        from clef_cuda import Decider
        from clef_cuda.model.quantize import Int8Weight
        from clef_cuda.serving.engine import EngineConfig
        from clef_cuda.tuning.autotune import autotune as tune

        self.decider = Decider.from_release(release, device="cpu", dtype=dtype, quantize=quantize, progress=False)
        self.trunk = self.decider.trunk
        if autotune != "off":
            config = EngineConfig(max_num_seqs=1, prefill_chunk_size=tokens, max_model_len=tokens + BLOCK)
            tune(self.trunk, config, autotune)
        self.cache = self.trunk.allocate_cache(1, -(-tokens // BLOCK) + 1, BLOCK, name="cpu_peers")
        head = self.trunk.lm_head
        self.lm_head = head.dequantize(self.trunk.ops) if isinstance(head, Int8Weight) else head

    def last_logits(self, ids: list[int]) -> torch.Tensor:
        from clef_cuda.model.trunk import ChunkBatch, SequenceChunk

        chunk = SequenceChunk(ids, 0, 0, list(range(-(-len(ids) // BLOCK))))
        with torch.inference_mode():
            hidden = self.trunk.forward(ChunkBatch.build([chunk], BLOCK, "cpu"), self.cache)
            return torch.nn.functional.linear(hidden[-1:].to(self.lm_head.dtype), self.lm_head)[0].float()


class LlamaCpp:
    """llama.cpp on a GGUF file: the whole prompt in one batch, the last token's logits."""

    def __init__(self, gguf: Path, tokens: int, threads: int) -> None:
        import llama_cpp

        self.llama_cpp = llama_cpp
        self.model = llama_cpp.Llama(
            str(gguf),
            n_ctx=tokens + 64,
            n_batch=tokens,
            n_ubatch=tokens,
            n_threads=threads,
            n_threads_batch=threads,
            logits_all=False,
            verbose=False,
        )
        self.vocab = self.model.n_vocab()

    def set_threads(self, threads: int) -> None:
        self.llama_cpp.llama_set_n_threads(self.model._ctx.ctx, threads, threads)

    def last_logits(self, ids: list[int]) -> torch.Tensor:
        self.model.reset()  # the KV cache and the recurrent state cleared (a hybrid model's memory)
        self.model.eval(ids)
        pointer = self.model._ctx.get_logits_ith(-1)
        values = ctypes.cast(pointer, ctypes.POINTER(ctypes.c_float * self.vocab)).contents
        return torch.tensor(list(values))


def llama_isa(llama_cpp) -> str:
    """What the loaded llama.cpp build computes with: the instruction sets its CPU backend reports as on."""
    info = llama_cpp.llama_print_system_info().decode(errors="replace")
    flags = dict(part.strip().rsplit(" = ", 1) for part in info.split("|") if " = " in part)
    wanted = ("AVX2", "AVX512", "AVX512_BF16", "AVX512_VNNI", "AVX_VNNI", "AMX_INT8")
    return "with " + ", ".join(name for name in wanted if flags.get(name) == "1")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama-cpp-src", type=Path, help="llama.cpp's source of the installed llama-cpp-python")
    parser.add_argument("--ours-only", action="store_true", help="no llama.cpp: ours against transformers alone")
    parser.add_argument(
        "--llama-cpp-lib", type=Path, help="a directory holding another llama.cpp build's libllama.so (e.g. AVX2 only)"
    )
    parser.add_argument("--shapes", default="mid,hidden-2048", help=f"of {','.join(SHAPES)}")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--autotune", choices=["fast", "off"], default="fast")
    parser.add_argument("--markdown", help="append the table to this file")
    args = parser.parse_args()
    shapes = args.shapes.split(",")
    if unknown := [s for s in shapes if s not in SHAPES]:
        parser.exit(2, f"cpu_peers: --shapes: unknown shape {unknown[0]!r} (of {', '.join(SHAPES)})\n")
    if not args.ours_only:
        if args.llama_cpp_lib is not None:
            if not (args.llama_cpp_lib / "libllama.so").is_file():
                parser.exit(2, f"cpu_peers: --llama-cpp-lib: no libllama.so in {args.llama_cpp_lib}\n")
            os.environ["LLAMA_CPP_LIB_PATH"] = str(args.llama_cpp_lib.resolve())  # read when llama_cpp is imported
        if importlib.util.find_spec("llama_cpp") is None:
            parser.exit(2, "cpu_peers: llama_cpp is not installed (pip install llama-cpp-python; or --ours-only)\n")
        if args.llama_cpp_src is None or not (args.llama_cpp_src / "convert_hf_to_gguf.py").is_file():
            parser.exit(2, f"cpu_peers: --llama-cpp-src: no convert_hf_to_gguf.py in {args.llama_cpp_src}\n")
    threads = [int(t) for t in args.threads.split(",")]
    from clef_cuda.kernels import ops

    isa = ops.cpu_isa()
    from clef_cuda.kernels.cpu_features import cpu_gemm_features, cpu_model

    cpu = cpu_model()
    rows = []
    generator = torch.Generator().manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        for shape in shapes:
            spec = SHAPES[shape]
            release = build_release(
                Path(tmp) / shape,
                text=spec["text"],
                head=spec["head"],
                vocab_size=spec["vocab_size"],
                max_shard_size="2GB",
            )
            ids = torch.randint(10, spec["vocab_size"] - 10, (args.tokens,), generator=generator).tolist()
            truth = reference_logits(release, ids)
            engines: dict[str, object] = {}
            torch.set_num_threads(max(threads))
            # int8 weights with this CPU's faster activations (--quantize int8 --dtype bf16 or f32): bf16 where
            # the GEMMs have bf16 dot products, f32 where bf16 would be converted in software (AVX2 only)
            int8_activations = torch.bfloat16 if cpu_gemm_features(isa).bf16 else torch.float32
            int8_name = f"ours int8 ({'bf16' if int8_activations == torch.bfloat16 else 'f32'} activations)"
            for name, dtype, quantize in (
                ("ours f32", torch.float32, "none"),
                ("ours bf16", torch.bfloat16, "none"),
                (int8_name, int8_activations, "int8"),
            ):
                engines[name] = Ours(release, dtype, quantize, args.tokens, args.autotune)
            if not args.ours_only:
                for outtype in ("f32", "f16", "bf16", "q8_0"):
                    gguf = convert(args.llama_cpp_src, release, outtype, Path(tmp) / f"{shape}-{outtype}.gguf")
                    engines[f"llama.cpp {outtype.upper()}"] = LlamaCpp(gguf, args.tokens, max(threads))
            errors = {name: (engine.last_logits(ids) - truth).abs().max().item() for name, engine in engines.items()}
            for n in threads:
                torch.set_num_threads(n)
                for engine in engines.values():
                    if isinstance(engine, LlamaCpp):
                        engine.set_threads(n)
                fns = [lambda e=engine, ids=ids: e.last_logits(ids) for engine in engines.values()]
                medians = decision_latency.interleaved_medians(fns, args.repeats, torch.device("cpu"))
                times = dict(zip(engines, medians, strict=True))
                peers = {k: v for k, v in times.items() if k.startswith("llama.cpp")}
                fastest_peer = min(peers, key=peers.get) if peers else None
                for name, seconds in times.items():
                    versus = f"{peers[fastest_peer] / seconds:.2f}x" if fastest_peer else "-"
                    rows.append(
                        [
                            shape,
                            str(n),
                            name,
                            f"{seconds:.2f}",
                            f"{args.tokens / seconds:,.0f}",
                            versus,
                            f"{errors[name]:.2e}",
                        ]
                    )
                    print(f"  {shape} {n} threads {name}: {seconds:.2f} s, |dlogit| {errors[name]:.2e}", flush=True)
                if fastest_peer:
                    print(f"  {shape} {n} threads: llama.cpp's fastest is {fastest_peer}", flush=True)
            del engines
            gc.collect()

    header = ["shape", "threads", "engine", "s", "tokens/s", "vs llama.cpp's fastest", "max \\|logit - transformers\\|"]
    title = (
        f"{time.strftime('%Y-%m-%d')}, {cpu}, our CPU kernels {isa} (torch's GEMMs: "
        f"{cpu_gemm_features(isa).describe()}), {args.tokens}-token prefill"
    )
    if not args.ours_only:
        import llama_cpp

        title += f"; llama.cpp {llama_isa(llama_cpp)}"
    lines = decision_latency.markdown_table(f"{title} (python benchmarks/cpu_peers.py)", header, rows)
    decision_latency.publish(lines, args.markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
