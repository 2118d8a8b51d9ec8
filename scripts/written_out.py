"""The heads whose gradient is written out, against autograd's through their own dense form
(``Head.dense`` / ``dense_reported`` on each block of complete rows, as ``AutogradHead``
takes a block's): forward + backward on the tiled backend, float32, the best of 3, the two
timed alternately in this process; each pair's loss and gradient compared first:

    python scripts/written_out.py 8192 256
    python scripts/written_out.py 8192 256 flex     # the flex kinds alone
    python scripts/written_out.py 16384 256 memory PairNTXentHead autograd   # one call's peak memory

The peak memory is the process's beyond the input and its gradient, one call after a small
first one (the one-time costs), one head and one form per process.

A head the tiled backend visits by other tiles than blocks of complete rows (the symmetric
panels of self-contrast, the ring, a column direction) cannot take autograd's block gradient
at all; the calls below are visited by row blocks. The masked softmax (``SoftmaxHead``) is
not among them: its positive terms are the engine's (pivots), and it serves every driver.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

import flashcl
from flashcl.engine.heads import ReportingHead, SoftplusHead
from flashcl.integrations.pytorch_metric_learning import NTXentLoss
from flashcl.losses.circle import CircleHead
from flashcl.losses.family_heads import DebiasedHead, SoftTargetHead
from flashcl.losses.flex_head import FlexHead
from flashcl.losses.multi_similarity import MultiSimilarityHead
from flashcl.losses.pair_nt_xent import PairNTXentHead
from flashcl.tools.procmem import reset_peak, status_mb


def _through_dense(head: Any, s: torch.Tensor, tile: Any, g_rows: Optional[torch.Tensor]) -> Tuple[Any, ...]:
    """A block's losses, what the head reports of it (None: a head that reports nothing) and,
    with the block's upstream gradients, ``dL/ds`` by autograd through its dense form."""
    with torch.enable_grad():
        leaf = s.detach().requires_grad_(True)
        if isinstance(head, ReportingHead):
            (out, _), reported = head.dense_reported(leaf, tile)
        else:
            (out, _), reported = head.dense(leaf, tile), None
        g = None if g_rows is None else torch.autograd.grad(out, leaf, g_rows.to(out.dtype))[0]
    return out.detach(), reported, g


def _autograd_methods(cls: type) -> Dict[str, Callable[..., Any]]:
    """``cls``'s methods by autograd through its dense form: ``rows_fused``, ``values``,
    ``report`` where it reports, and the backward's ``begin_grad`` and ``grad`` (a forward
    without the upstream gradient); the head's own reductions never run."""
    written = {name: getattr(cls, name) for name in ("values", "report") if hasattr(cls, name)}

    def rows_fused(self: Any, s: torch.Tensor, tile: Any, st: Any, g_row: Optional[torch.Tensor]) -> Any:
        out, reported, g = _through_dense(self, s, tile, None if g_row is None else g_row[tile.r0 : tile.r1])
        # the state's blocks: (first row, the block's losses, what the head reports of it)
        st.__dict__.setdefault("autograd_blocks", []).append((tile.r0, out, reported))
        return None if g is None else s.copy_(g)

    def values(self: Any, st: Any) -> Any:
        blocks = sorted(st.__dict__.get("autograd_blocks", []), key=lambda x: x[0])
        return (torch.cat([b[1] for b in blocks]), None) if blocks else written["values"](self, st)

    def report(self: Any, st: Any) -> Any:
        blocks = sorted(st.__dict__.get("autograd_blocks", []), key=lambda x: x[0])
        if not blocks:
            return written["report"](self, st)
        parts = zip(*[b[2] for b in blocks])  # per-row results joined, counts summed
        return tuple(torch.cat(p) if p[0].dim() else torch.stack(p).sum(0) for p in parts)

    def begin_grad(self: Any, st: Any, g_row: torch.Tensor, g_col: Optional[torch.Tensor]) -> None:
        st.g_row = g_row

    def grad(self: Any, s: torch.Tensor, tile: Any, st: Any, buf: Optional[torch.Tensor] = None) -> torch.Tensor:
        return s.copy_(_through_dense(self, s, tile, st.g_row[tile.r0 : tile.r1])[2])

    out: Dict[str, Callable[..., Any]] = {
        "rows_fused": rows_fused,
        "values": values,
        "begin_grad": begin_grad,
        "grad": grad,
    }
    if "report" in written:
        out["report"] = report
    return out


def main() -> None:
    b, d = int(sys.argv[1]), int(sys.argv[2])
    g = torch.Generator().manual_seed(0)
    e, other = torch.randn(b, d, generator=g), torch.randn(b, d, generator=g)
    t = torch.rand(b, generator=g) * b / 8  # timestamps, about 8 samples per time unit
    doc = torch.randint(0, b // 4, (b,), generator=g)  # about 4 samples per document
    y = torch.randint(0, b // 8, (b,), generator=g)  # about 8 samples per class
    same = lambda a, b: a.y == b.y  # noqa: E731
    pml = NTXentLoss(temperature=0.1, backend="tiled")
    flex: List[Tuple[str, type, Callable[[torch.Tensor], torch.Tensor]]] = [
        (
            "flex_loss, softmax: a time window, same-document pairs out",
            FlexHead,
            lambda x: flashcl.flex_loss(
                x, rows={"t": t[: len(x)], "doc": doc[: len(x)]}, positive=lambda a, b: (a.t - b.t).abs() <= 1.0,
                exclude=lambda a, b: (a.doc == b.doc) & ((a.t - b.t).abs() > 1.0), backend="tiled",
            ),
        ),
        (
            "flex_loss, softmax: labels, a margin by score_mod",
            FlexHead,
            lambda x: flashcl.flex_loss(
                x, rows={"y": y[: len(x)]}, positive=same, score_mod=lambda s, a, b: s - 2.0 * (a.y == b.y),
                backend="tiled",
            ),
        ),
        (
            "flex_loss, kind='multi_similarity'",
            FlexHead,
            lambda x: flashcl.flex_loss(
                x, rows={"y": y[: len(x)]}, positive=same, kind="multi_similarity", temperature=1.0, backend="tiled"
            ),
        ),
        (
            "flex_loss, kind='sigmoid'",
            FlexHead,
            lambda x: flashcl.flex_loss(x, rows={"y": y[: len(x)]}, positive=same, kind="sigmoid", backend="tiled"),
        ),
    ]  # fmt: skip
    others: List[Tuple[str, type, Callable[[torch.Tensor], torch.Tensor]]] = [
        (
            "siglip_loss",
            SoftplusHead,
            lambda x: flashcl.siglip_loss(x, other[: len(x)], 10.0, -10.0, normalize=True, backend="tiled"),
        ),
        ("circle_loss", CircleHead, lambda x: flashcl.circle_loss(x, y[: len(x)], backend="tiled")),
        (
            "multi_similarity_loss",
            MultiSimilarityHead,
            lambda x: flashcl.multi_similarity_loss(x, y[: len(x)], backend="tiled"),
        ),
        (
            "nt_xent_loss, estimator='debiased'",
            DebiasedHead,
            lambda x: flashcl.nt_xent_loss(x[: len(x) // 2], x[len(x) // 2 :], estimator="debiased", backend="tiled"),
        ),
        (
            "distill_loss",
            SoftTargetHead,
            lambda x: flashcl.distill_loss(
                x,
                other[: len(x)],
                other[: len(x)] + 0.1,
                other[: len(x)],
                scale=10.0,
                teacher_scale=10.0,
                backend="tiled",
            ),
        ),
        (
            "pytorch-metric-learning's NTXentLoss, ref_emb",
            PairNTXentHead,
            lambda x: pml(x, y[: len(x)], ref_emb=other[: len(x)], ref_labels=y[: len(x)]),
        ),
    ]
    cases = flex if sys.argv[3:4] == ["flex"] else flex + others
    if sys.argv[3:4] == ["memory"]:
        head, form = sys.argv[4], sys.argv[5]
        name, cls, call = next(c for c in cases if c[1].__name__ == head)
        for m, f in _autograd_methods(cls).items() if form == "autograd" else ():
            setattr(cls, m, f)
        call(e[:512].clone().requires_grad_(True)).backward()  # the one-time costs (thread pools) first
        x = e.clone().requires_grad_(True)
        base = reset_peak() or 0.0
        call(x).backward()
        peak = (status_mb("VmHWM") or 0.0) - base - x.numel() * 4 / 2**20  # its gradient (x came before)
        print(f"{name} ({head}, {form}), B = {b:,}, D = {d}: peak {peak:.0f} MB beyond the input and its gradient")
        return
    print(f"B = {b:,}, D = {d}, float32, tiled, forward + backward, the best of 3:")
    for name, cls, call in cases:
        written = {
            m: cls.__dict__[m] for m in ("rows_fused", "values", "report", "begin_grad", "grad") if m in cls.__dict__
        }
        autograd = _autograd_methods(cls)

        def step(
            by_autograd: bool,
            call: Callable[[torch.Tensor], torch.Tensor] = call,
            cls: type = cls,
            autograd: Dict[str, Callable[..., Any]] = autograd,
            written: Dict[str, Any] = written,
        ) -> Any:
            for m, f in autograd.items() if by_autograd else ():
                setattr(cls, m, f)
            x = e.clone().requires_grad_(True)
            t0 = time.perf_counter()
            loss = call(x)
            loss.backward()
            seconds = time.perf_counter() - t0
            for m in autograd if by_autograd else ():
                delattr(cls, m) if m not in written else setattr(cls, m, written[m])
            return seconds, loss.detach(), x.grad

        (_, want, want_grad), (_, got, grad) = step(False), step(True)
        if not bool(torch.isfinite(grad).all()):
            print(f"  {name} ({cls.__name__}): autograd's gradient is not finite (the written-out one is)")
            continue
        gap = float((grad - want_grad).abs().max() / want_grad.abs().max())
        times: Dict[bool, List[float]] = {False: [], True: []}
        for _ in range(3):
            for by_autograd in (False, True):
                times[by_autograd].append(step(by_autograd)[0])
        mine, theirs = min(times[False]), min(times[True])
        print(
            f"  {name} ({cls.__name__}): written out {mine:.2f} s, autograd {theirs:.2f} s ({theirs / mine:.2f}x); "
            f"loss {float(want):.6f} / {float(got):.6f}, gradients within {gap:.1e} of the largest",
            flush=True,
        )


if __name__ == "__main__":
    main()
