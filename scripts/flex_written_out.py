"""The flex head's written-out gradient against autograd's through its own dense form
(``FlexHead.dense_reported`` on each block of complete rows, as ``AutogradHead`` takes a
block's), forward + backward on the tiled backend, float32, the best of 3, the two timed
alternately in this process; each pair's loss and gradient compared first:

    python scripts/flex_written_out.py 8192 256
"""

from __future__ import annotations

import sys
import time
from typing import Any, Dict, List, Optional

import torch

import flashcl
from flashcl.losses import flex_head

HEAD = flex_head.FlexHead
WRITTEN_OUT = (HEAD.rows_fused, HEAD.values)


def _rows_fused(self: Any, s: torch.Tensor, tile: Any, st: Any, g_row: Optional[torch.Tensor]) -> Any:
    """A block of complete rows' losses and their gradient by autograd through the dense form."""
    rows = slice(tile.r0, tile.r1)
    with torch.enable_grad():
        leaf = s.detach().requires_grad_(True)
        (out, _), (valid,) = self.dense_reported(leaf, tile)
        g = None if g_row is None else torch.autograd.grad(out, leaf, g_row[rows].to(out.dtype))[0]
    if not hasattr(st, "autograd_rows"):
        st.autograd_rows = torch.zeros_like(st.row)
    st.autograd_rows[rows] = out.detach()
    if st.valid is None:
        st.valid = torch.ones_like(st.row, dtype=torch.bool)
    st.valid[rows] = valid
    return None if g is None else s.copy_(g)


def _values(self: Any, st: Any) -> Any:
    return (st.autograd_rows, None) if hasattr(st, "autograd_rows") else WRITTEN_OUT[1](self, st)


def _use(autograd: bool) -> None:
    HEAD.rows_fused, HEAD.values = (_rows_fused, _values) if autograd else WRITTEN_OUT  # type: ignore[method-assign]


def main() -> None:
    b, d = int(sys.argv[1]), int(sys.argv[2])
    g = torch.Generator().manual_seed(0)
    e = torch.randn(b, d, generator=g)
    t = torch.rand(b, generator=g) * b / 8  # timestamps, about 8 samples per time unit
    doc = torch.randint(0, b // 4, (b,), generator=g)  # about 4 samples per document
    y = torch.randint(0, b // 8, (b,), generator=g)  # about 8 samples per class
    same = lambda a, b: a.y == b.y  # noqa: E731
    cases: Dict[str, Dict[str, Any]] = {
        "softmax, a time window, same-document pairs out": dict(
            rows={"t": t, "doc": doc},
            positive=lambda a, b: (a.t - b.t).abs() <= 1.0,
            exclude=lambda a, b: (a.doc == b.doc) & ((a.t - b.t).abs() > 1.0),
        ),
        "softmax, labels, a margin by score_mod": dict(
            rows={"y": y}, positive=same, score_mod=lambda s, a, b: s - 2.0 * (a.y == b.y)
        ),
        "kind='multi_similarity', labels": dict(rows={"y": y}, positive=same, kind="multi_similarity", temperature=1.0),
        "kind='sigmoid', labels": dict(rows={"y": y}, positive=same, kind="sigmoid"),
    }
    print(f"B = {b:,}, D = {d}, float32, tiled, forward + backward, the best of 3:")
    for name, opts in cases.items():

        def step(autograd: bool, opts: Dict[str, Any] = opts) -> Any:
            _use(autograd)
            x = e.clone().requires_grad_(True)
            t0 = time.perf_counter()
            loss = flashcl.flex_loss(x, backend="tiled", **opts)
            loss.backward()
            seconds = time.perf_counter() - t0
            _use(False)
            return seconds, loss.detach(), x.grad

        (_, want, want_grad), (_, got, grad) = step(False), step(True)
        gap = float((grad - want_grad).abs().max() / want_grad.abs().max())
        times: Dict[bool, List[float]] = {False: [], True: []}
        for _ in range(3):
            for autograd in (False, True):
                times[autograd].append(step(autograd)[0])
        mine, theirs = min(times[False]), min(times[True])
        print(
            f"  {name}: written out {mine:.2f} s, autograd {theirs:.2f} s ({theirs / mine:.2f}x); "
            f"loss {float(want):.6f} / {float(got):.6f}, gradients within {gap:.1e} of the largest"
        )


if __name__ == "__main__":
    main()
