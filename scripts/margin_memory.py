"""Per-rank memory and time of ArcFace with the class weights sharded across gloo
processes on one machine: C classes, B embeddings per rank, D = 128, each rank's peak
resident memory during its first forward + backward beyond what it held before (its
weight slice, its embeddings) and beyond its weight slice's gradient.

    python scripts/margin_memory.py 10000000 4            # C = 10M on 4 processes
    python scripts/margin_memory.py 1000000 2 replicated  # every rank holding all of W
"""

from __future__ import annotations

import sys

from flashcl.bench.distbench import measure_dist


def main() -> None:
    c, world = int(sys.argv[1]), int(sys.argv[2])
    impl = sys.argv[3] if len(sys.argv) > 3 else "sharded"
    params = {"B": 1024, "D": 128, "C": c, "world": world, "loss": "margin", "impl": impl, "repeats": 0}
    r = measure_dist(params, 3600.0)
    if r["status"] != "ok":
        raise SystemExit(f"{r['status']}: {r.get('error', '')}")
    print(f"C = {c:,}, {world} processes ({impl}), B = 1024 per rank, D = 128: loss {r['loss']:.4f}")
    for i, rank in enumerate(r["per_rank"]):
        beyond = rank["peak_mb"] - rank["grad_mb"]
        print(
            f"  rank {i}: first forward + backward {rank['first_s']:.1f} s, peak {rank['peak_mb']:.0f} MB above its "
            f"inputs, {beyond:.0f} MB beyond its weight slice's gradient ({rank['grad_mb']:.0f} MB)"
        )


if __name__ == "__main__":
    main()
