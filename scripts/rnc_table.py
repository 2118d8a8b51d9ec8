"""Rank-N-Contrast forward + backward, float32, two views of B samples (the published
setting), time and peak memory beyond the inputs and their gradient, in a fresh child
process per case: flashcl's tiled backend against the published ``RnCLoss`` (its
``loss.py``, given by path: it is not a package), which loops over the 2B - 1 positives
building a 2B x 2B mask each time.

    python scripts/rnc_table.py path/to/Rank-N-Contrast/loss.py 256 512 1024 2048 4096 [--published-up-to 2048]
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

CHILD = r"""
import importlib.util, json, sys, time, torch, flashcl
from flashcl.tools.procmem import reset_peak, status_mb
impl, path, b, d = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
g = torch.Generator().manual_seed(0)
f = torch.randn(b, 2, d, generator=g).requires_grad_(True)
y = torch.rand(b, 1, generator=g) * 100
if impl == "published":
    spec = importlib.util.spec_from_file_location("rnc", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    loss_fn = module.RnCLoss(temperature=2)
else:
    loss_fn = lambda x, t: flashcl.rank_n_contrast_loss(x, t, temperature=2.0, backend="tiled")
small = f[:8].detach().clone().requires_grad_(True)
loss_fn(small, y[:8]).backward()
base = reset_peak() or 0.0
t0 = time.perf_counter()
loss = loss_fn(f, y)
loss.backward()
seconds = time.perf_counter() - t0
peak = (status_mb("VmHWM") or 0.0) - base - f.numel() * 4 / 2**20
print(json.dumps({"impl": impl, "B": b, "s": seconds, "mb": peak, "loss": float(loss)}))
"""


def main() -> None:
    args = sys.argv[1:]
    limit = 2048
    if "--published-up-to" in args:
        at = args.index("--published-up-to")
        limit = int(args[at + 1])
        del args[at : at + 2]
    path, sizes = args[0], [int(x) for x in args[1:]]
    d = 128
    for b in sizes:
        for impl in ("flashcl", "published"):
            if impl == "published" and b > limit:  # O(B^3): 2,048 takes minutes on 2 cores
                print(f"B = {b}: published: not run (its loop is O(B^3); --published-up-to {limit})", flush=True)
                continue
            start = time.perf_counter()
            try:
                out = subprocess.run(
                    [sys.executable, "-c", CHILD, impl, path, str(b), str(d)],
                    capture_output=True, text=True, timeout=3600, check=True,
                )  # fmt: skip
                row = json.loads(out.stdout.strip().splitlines()[-1])
                print(
                    f"B = {b}, D = {d}: {impl}: {row['s']:.2f} s, {row['mb']:.0f} MB, loss {row['loss']:.6f}",
                    flush=True,
                )
            except subprocess.TimeoutExpired:
                print(f"B = {b}: {impl}: over {time.perf_counter() - start:.0f} s", flush=True)
            except subprocess.CalledProcessError as e:  # killed by the kernel: out of memory
                how = "killed (out of memory)" if e.returncode == -9 else f"failed ({e.returncode})"
                print(f"B = {b}, D = {d}: {impl}: {how} after {time.perf_counter() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
