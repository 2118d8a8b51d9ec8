"""The late-interaction equality table: flashcl's drop-ins against pylate's and
colpali-engine's own loss classes (float64, padding of different lengths), every
case of tests/test_colpali.py and tests/test_pylate.py, by backend: the largest
absolute difference of the value and of every gradient (colpali: the raw token
embeddings'; pylate: every parameter's of a small token-embedding model).

    python scripts/late_interaction_table.py    # from the project's root, its venv active
"""

from __future__ import annotations

import pathlib
import sys
import warnings

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "tests"))
import test_colpali as c  # noqa: E402
import test_pylate as p  # noqa: E402


def _gap(got: tuple, want: tuple) -> float:
    worst = float((got[0] - want[0]).abs().max())
    for a, b in zip(got[1], want[1]):
        worst = max(worst, float((a - b).abs().max()))
    return worst


def colpali_rows() -> dict:
    out: dict = {}
    for param in c.cases():
        name, options, backend = param.values
        b, n, lq, ld, dim = 3, 5, 4, 6, 8
        sigmoid = name == "ColbertSigmoidLoss"
        offset = 0 if sigmoid else 1
        q, qm = c.tokens((b, lq, dim), 0)
        d, dm = c.tokens((b if sigmoid else n, ld, dim), 1)
        inputs, masks = [q, d], [qm, dm]
        if "Negative" in name:
            neg, negm = c.tokens((b, 2, ld + 1, dim), 2)
            inputs.append(neg)
            masks.append(negm)
        want = c.run_loss(getattr(c.peer, name)(**options), inputs, masks, offset)
        got = c.run_loss(getattr(c.ours, name)(**options, backend=backend, block_size=2), inputs, masks, offset)
        key = (f"colpali {name}", ", ".join(f"{k}={v}" for k, v in options.items()) or "defaults")
        out.setdefault(key, {})[backend] = _gap(got, want)
    return out


def pylate_rows() -> dict:
    out: dict = {}
    for backend in p.BACKENDS:
        for options in p.CONTRASTIVE:
            for expansion in (False, True):
                for columns in (1, 2):
                    features = [p.tokenized(3, 5, 0)] + [p.tokenized(3, 7, 1 + k) for k in range(columns)]
                    model = p.TinyColBERT(expansion)
                    want = p.one_step(p.pl_losses.Contrastive(model, **options), features)
                    got = p.one_step(p.ours.Contrastive(model, **options, backend=backend, block_size=2), features)
                    opts = ", ".join(f"{k}={v}" for k, v in options.items()) or "defaults"
                    key = ("pylate Contrastive", f"{opts}; expansion={expansion}, columns={columns}")
                    out.setdefault(key, {})[backend] = _gap(got, want)
        for size_average in (True, False):
            features = [p.tokenized(5, 5, 3), p.tokenized(5, 6, 4), p.tokenized(5, 6, 5)]
            model = p.TinyColBERT()
            opts = {"mini_batch_size": 2, "size_average": size_average, "temperature": 0.1}
            want = p.one_step(p.pl_losses.CachedContrastive(model, **opts), features)
            got = p.one_step(p.ours.CachedContrastive(model, **opts, backend=backend), features)
            out.setdefault(("pylate CachedContrastive", f"size_average={size_average}"), {})[backend] = _gap(got, want)
        for options in ({}, {"normalize_scores": False}, {"size_average": False}):
            for expansion in (False, True):
                features = [p.tokenized(3, 5, 6), p.tokenized(12, 7, 7)]
                labels = torch.randn(3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(8))
                model = p.TinyColBERT(expansion)
                want = p.one_step(p.pl_losses.Distillation(model, **options), features, labels)
                got = p.one_step(p.ours.Distillation(model, **options, backend=backend, block_size=2), features, labels)
                opts = ", ".join(f"{k}={v}" for k, v in options.items()) or "defaults"
                out.setdefault(("pylate Distillation", f"{opts}; expansion={expansion}"), {})[backend] = _gap(got, want)
    return out


def main() -> None:
    warnings.simplefilter("ignore")
    rows = {**colpali_rows(), **pylate_rows()}
    backends = ("reference", "dense", "tiled")
    print("| peer class | options | " + " | ".join(backends) + " |")
    print("|---|---|" + "---|" * len(backends))
    for (cls, opts), gaps in rows.items():
        print(f"| {cls} | {opts} | " + " | ".join(f"{gaps[b]:.1e}" for b in backends) + " |")
    print(f"\n{len(rows)} cases x {len(backends)} backends; largest {max(max(g.values()) for g in rows.values()):.1e}")


if __name__ == "__main__":
    main()
