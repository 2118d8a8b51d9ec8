"""The multi-process equality table: every loss case of tests/test_backends_across.py
on 2 and 3 gloo processes (uneven batches), each backend against one process on the
concatenated batch (the float64 reference): the largest absolute difference of the
summed values and of every rank's gradient rows, by backend.

    python scripts/across_table.py            # from the project's root, its venv active
"""

from __future__ import annotations

import pathlib
import sys
import tempfile

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "tests"))
import test_backends_across as t  # noqa: E402


def _errors(world: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(t.worker, args=(world, tmp), nprocs=world, join=True)
        ranks = [torch.load(pathlib.Path(tmp) / f"rank{r}.pt") for r in range(world)]
    sizes = t.SIZES[world]
    d = t.data(sum(sizes))
    out = {}
    for name, (fn, inputs) in t.cases(d, sizes, 0, {"backend": "reference"}, single=True).items():
        leaves = [x.detach().clone().requires_grad_(True) for x in inputs]
        want = fn(*leaves)
        grads = torch.autograd.grad(want, leaves)
        for backend in t.BACKENDS:
            got = [r[(backend, name)] for r in ranks]
            value = float((sum(v for v, _ in got) - want.detach()).abs().max())
            grad = 0.0
            for i, g in enumerate(grads):
                if g.dim() == 0 or (i, name) in t.REPLICATED:
                    grad = max(grad, float((sum(r[1][i] for r in got) - g).abs().max()))
                    continue
                per = 1 if g.shape[0] == sum(sizes) else 2
                for r in range(world):
                    grad = max(grad, float((got[r][1][i] - g[t.shard(sizes, r, per)]).abs().max()))
            out[(name, backend)] = (value, grad)
    return out


def main() -> None:
    tables = {world: _errors(world) for world in (2, 3)}
    names = sorted({name for name, _ in tables[2]})
    head = " | ".join(f"{b} ({w} proc.)" for w in (2, 3) for b in t.BACKENDS)
    print(f"| case | {head} |")
    print("|---|" + "---|" * (2 * len(t.BACKENDS)))
    for name in names:
        cells = []
        for w in (2, 3):
            for b in t.BACKENDS:
                value, grad = tables[w][(name, b)]
                cells.append(f"{max(value, grad):.1e}")
        print(f"| {name} | " + " | ".join(cells) + " |")
    worst = max(max(v, g) for table in tables.values() for v, g in table.values())
    print(
        f"\n{len(names)} cases x {len(t.BACKENDS)} backends x 2 worlds; largest difference (value or gradient): "
        f"{worst:.1e}"
    )


if __name__ == "__main__":
    main()
