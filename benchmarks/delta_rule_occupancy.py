#!/usr/bin/env python3
"""How the chunked delta rule's three passes sit on each card: for every tensor-core card in
csrc/common/arch_limits.h (its SMs and per-SM limits), clef-flash's delta net (16 key / 32 value heads x 128) and
clef 27B's (16 / 48 x 128), one record of 2,048 and 16,384 tokens: each pass's CTAs, the CTAs an SM holds at
once (shared memory, threads, block slots, registers at 255 a thread: clef::blocks_per_sm) and the waves they
run in, with the state pass's variant (gdr_state_variant: "s64" = 64 state columns a CTA, its tiles staged in
shared memory; "d128" = 128, read from the workspace). Computed by the launchers' own functions
(csrc/gated_delta_rule/gated_delta_rule.h) compiled into a host probe: no GPU needed. Table last.

    python benchmarks/delta_rule_occupancy.py
    python benchmarks/delta_rule_occupancy.py --records 4

The state pass is the sequential one (each CTA walks its record's every chunk), so its waves multiply the walk:
one wave is the target wherever some variant fits. The prepare and output passes are a CTA per (chunk, head), all
independent: their waves are throughput, as any large grid's.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODELS = {"clef-flash": (16, 32), "clef 27B": (16, 48)}  # (key heads, value heads) at head dim 128
TOKENS = (2048, 16384)

PROBE = r"""
#include <cstdio>
#include <cstdlib>
#include "gated_delta_rule/gated_delta_rule.h"
// argv: cc sms key_heads value_heads tokens records -> prepare, state and output: blocks per_sm waves (+ names)
int main(int, char** argv) {
  using namespace clef;
  const int cc = std::atoi(argv[1]), sms = std::atoi(argv[2]), hk = std::atoi(argv[3]), hv = std::atoi(argv[4]);
  const long long tokens = std::atoll(argv[5]);
  const int records = std::atoi(argv[6]);
  const CudaDevice device = arch_device(cc, sms);
  const int d = 128;
  const long long chunks = (tokens / records + kGdrChunk - 1) / kGdrChunk * records;
  auto waves = [&](long long blocks, int per_sm) {
    return per_sm ? (blocks + per_sm * sms - 1) / (1LL * per_sm * sms) : -1;
  };
  const int prepare_sm = blocks_per_sm(device, kGdrChunkThreads, gdr_prepare_layout(d).bytes);
  const GdrStateVariant v = gdr_state_variant(d, hv, records, device);
  const GdrStateFit fit = gdr_state_fit(d, hv, records, v, device);
  const int oc = gdr_output_columns(d, device.smem_limit);
  const int output_sm = blocks_per_sm(device, kGdrChunkThreads, gdr_output_layout(d, oc).bytes);
  std::printf("%lld %d %lld %c%d %lld %d %lld %d %lld %d %lld\n", chunks * hv, prepare_sm,
              waves(chunks * hv, prepare_sm), v.staged ? 's' : 'd', v.columns, static_cast<long long>(fit.blocks),
              fit.per_sm, static_cast<long long>(fit.waves), oc, chunks * hv, output_sm, waves(chunks * hv, output_sm));
}
"""


def check_archs():
    spec = importlib.util.spec_from_file_location("check_archs", ROOT / "scripts" / "check_archs.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def cards() -> list[tuple[int, str, int]]:
    """(cc, card, SMs) of every tensor-core arch in csrc/common/arch_limits.h."""
    probe = r"""
#include <cstdio>
#include "common/arch_limits.h"
int main() {
  for (const auto& a : clef::kCheckedArchs) std::printf("%d %d %s\n", a.compute_capability, a.multiprocessors, a.card);
}
"""
    rows = []
    for line in check_archs().host_probe(probe).splitlines():
        cc, sms, card = line.split(" ", 2)
        if int(cc) >= 70:
            rows.append((int(cc), card, int(sms)))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=1, help="records a step (default 1: one long record)")
    args = parser.parse_args()
    header = (
        f"{'card':9s} {'arch':6s} {'SMs':>4s} {'model':10s} {'tokens':>6s} | {'prepare CTAs':>12s} {'/SM':>3s} "
        f"{'waves':>5s} | {'state':5s} {'CTAs':>5s} {'/SM':>3s} {'waves':>5s} | {'output':6s} {'CTAs':>6s} {'/SM':>3s} "
        f"{'waves':>5s}"
    )
    lines = [header]
    one_wave = {}
    for cc, card, sms in cards():
        for model, (hk, hv) in MODELS.items():
            for tokens in TOKENS:
                out = host_probe_cached(cc, sms, hk, hv, tokens, args.records)
                p_blocks, p_sm, p_waves, variant, s_blocks, s_sm, s_waves, oc, o_blocks, o_sm, o_waves = out.split()
                lines.append(
                    f"{card:9s} sm_{cc:<3d} {sms:>4d} {model:10s} {tokens:>6d} | {p_blocks:>12s} {p_sm:>3s} "
                    f"{p_waves:>5s} | {variant:5s} {s_blocks:>5s} {s_sm:>3s} {s_waves:>5s} | {oc + ' col':6s} "
                    f"{o_blocks:>6s} {o_sm:>3s} {o_waves:>5s}"
                )
                one_wave.setdefault((card, model), s_waves == "1")
    print(f"chunked delta rule occupancy, head dim 128, {args.records} record(s) a step (csrc/common/arch_limits.h)\n")
    print("\n".join(lines))
    flash = [card for (card, model), ok in one_wave.items() if model == "clef-flash" and ok]
    print(f"\nstate pass in one wave for clef-flash: {', '.join(flash) or 'none'}")
    return 0


_PROBE_EXE: dict[str, Path] = {}


def host_probe_cached(*args) -> str:
    """PROBE compiled once (check_archs.compile_probe), run per row."""
    import subprocess
    import tempfile

    if "exe" not in _PROBE_EXE:
        _PROBE_EXE["exe"] = check_archs().compile_probe(PROBE, Path(tempfile.mkdtemp(prefix="gdr-occupancy-")))
    return subprocess.run([str(_PROBE_EXE["exe"]), *map(str, args)], capture_output=True, text=True, check=True).stdout


if __name__ == "__main__":
    sys.exit(main())
