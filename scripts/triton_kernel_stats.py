"""Compiles the Triton kernels for each dtype and width and records what the
compiler did with them: registers, spills, whether the PTX uses Hopper's wgmma,
and the launch configuration. One JSON line per kernel, to stdout and to
``--out`` as it goes. Needs a CUDA GPU. A development tool, not part of the package.

    python scripts/triton_kernel_stats.py --out stats.jsonl
"""

from __future__ import annotations

import argparse
import json

import torch

from flashcl.triton import driver as tcore


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="kernel-stats.jsonl")
    parser.add_argument("--widths", default="64,256,768,1000,4096")
    args = parser.parse_args()
    open(args.out, "w").close()
    b = 512
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for d in (int(w) for w in args.widths.split(",")):
            q = torch.randn(b, d, device="cuda", dtype=dtype)
            iq = torch.ones(b, device="cuda")
            cfg = tcore.default_config(d, dtype)
            lse, _, lse_kernel = tcore.row_lse(q, q, iq, iq, 10.0, True, 0, cfg)
            g = torch.full((b,), 1.0 / b, device="cuda")
            _, _, compiled = tcore.gradients(q, q, iq, iq, 10.0, True, 0, lse, g, None, None, cfg)
            compiled["lse"] = lse_kernel
            for name, kernel in compiled.items():
                ptx = kernel.asm.get("ptx", "")
                row = {
                    "kernel": name,
                    "dtype": str(dtype).replace("torch.", ""),
                    "D": d,
                    "config": cfg._asdict(),
                    "n_regs": getattr(kernel, "n_regs", None),
                    "n_spills": getattr(kernel, "n_spills", None),
                    "wgmma": "wgmma" in ptx,
                    "mma": "mma" in ptx,
                    "shared": getattr(kernel, "shared", None),
                }
                print(json.dumps(row), flush=True)
                with open(args.out, "a") as f:
                    f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
