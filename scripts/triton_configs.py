"""Times the Triton backend's launch configurations on a CUDA GPU (bfloat16 CLIP
and InfoNCE, forward + backward) against the three cuBLAS GEMMs of the same
shape, to choose ``flashcl.triton.driver.default_config``. Each configuration's loss is
checked against the tiled backend's (float32 accumulation both), so a fast but
wrong configuration shows. A development tool, not part of the package.

    python scripts/triton_configs.py --json configs.json [--budget 120]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any, Callable, Dict, List, Tuple

import torch

import flashcl
import flashcl.triton.driver as tcore

DEV = "cuda"
# by D: (block_m, block_n, block_k, block_do, num_warps, num_stages); every kernel
# loops over D in block_k chunks and writes gradients in block_do chunks
CANDIDATES: Dict[int, List[Tuple[int, int, int, int, int, int]]] = {
    256: [
        (64, 64, 64, 256, 4, 2),
        (128, 64, 64, 256, 8, 2),
        (64, 128, 64, 256, 8, 2),
        (128, 128, 64, 128, 8, 3),
        (64, 64, 32, 256, 4, 3),
        (128, 64, 32, 128, 8, 3),
    ],
    768: [(64, 64, 64, 256, 4, 2), (128, 64, 64, 256, 8, 3), (128, 128, 64, 128, 8, 3), (64, 64, 64, 128, 4, 3)],
}


def cuda_time(fn: Callable[[], Any], repeats: int = 3) -> float:
    fn()
    if DEV == "cpu":  # a dry run of this script under TRITON_INTERPRET=1
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def gemm3(b: int, d: int) -> float:
    e = torch.randn(b, d, device=DEV, dtype=torch.bfloat16)
    s = torch.empty(b, b, device=DEV, dtype=torch.bfloat16)
    g = torch.rand(b, b, device=DEV, dtype=torch.bfloat16)
    o1, o2 = torch.empty_like(e), torch.empty_like(e)

    def step() -> None:
        torch.mm(e, e.T, out=s)
        torch.mm(g, e, out=o1)
        torch.mm(g.T, e, out=o2)

    return cuda_time(step)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default="triton-configs.json")
    ap.add_argument("--budget", type=float, default=120.0, help="seconds; no new configuration after this")
    ap.add_argument("--batch", type=int, default=32768)
    ap.add_argument("--device", default="cuda", help="cpu: a dry run under TRITON_INTERPRET=1")
    args = ap.parse_args()
    global DEV
    DEV = args.device
    t_start = time.time()
    default_config = tcore.default_config
    rows: List[Dict[str, Any]] = []
    b = args.batch
    for d in (256, 768):
        gen = torch.Generator(device=DEV).manual_seed(0)
        x = torch.randn(b, d, device=DEV, generator=gen).bfloat16().requires_grad_(True)
        y = torch.randn(b, d, device=DEV, generator=gen).bfloat16().requires_grad_(True)
        scale = torch.tensor(1 / 0.07, device=DEV)
        bound = gemm3(b, d)
        ref = {
            "clip": float(flashcl.clip_loss(x.detach(), y.detach(), scale, backend="tiled")),
            "info_nce": float(flashcl.info_nce_loss(x.detach(), y.detach(), temperature=0.07, backend="tiled")),
        }
        losses = {
            "clip": lambda x=x, y=y, scale=scale: flashcl.clip_loss(x, y, scale, backend="triton"),
            "info_nce": lambda x=x, y=y: flashcl.info_nce_loss(x, y, temperature=0.07, backend="triton"),
        }
        print(f"B={b} D={d}: 3 GEMMs {bound * 1e3:.2f} ms; tiled losses {ref}", flush=True)
        for cand in [None] + CANDIDATES[d]:
            if time.time() - t_start > args.budget:
                print("budget spent", flush=True)
                break
            if cand is None:
                tcore.default_config = default_config
                name = "default " + str(tuple(default_config(d, torch.bfloat16)))
            else:
                cfg = tcore.Config(*cand)
                tcore.default_config = lambda _d, _dt, c=cfg: c  # noqa: E731
                name = str(cand)
            row: Dict[str, Any] = {"B": b, "D": d, "config": name, "gemm3_s": bound}
            for loss_name, fn in losses.items():
                try:
                    t0 = time.time()
                    value = float(fn())
                    row[f"{loss_name}_compile_s"] = time.time() - t0
                    t = cuda_time(lambda fn=fn: fn().backward())
                    row[f"{loss_name}_s"] = t
                    row[f"{loss_name}_x_gemm3"] = t / bound
                    row[f"{loss_name}_rel_err_vs_tiled"] = abs(value - ref[loss_name]) / abs(ref[loss_name])
                except Exception as e:  # a configuration that does not compile or run
                    row[f"{loss_name}_error"] = f"{type(e).__name__}: {str(e)[:200]}"
                x.grad = y.grad = None
            print(json.dumps(row), flush=True)
            rows.append(row)
        tcore.default_config = default_config
    with open(args.json, "w") as f:
        gpu = torch.cuda.get_device_name(0) if DEV != "cpu" else "cpu"
        json.dump({"gpu": gpu, "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
