"""Supervised contrastive training on real data: scikit-learn's handwritten digits.

    python examples/digits_supcon.py                 # SupCon, labels give the positives
    python examples/digits_supcon.py --loss nt_xent  # self-supervised: two augmented views
    python examples/digits_supcon.py --fast          # fewer epochs (the test suite's run)

The 1797 8x8 digit images ship inside scikit-learn (no download). A held-out
30% split is embedded by (a) the raw pixels, (b) an encoder trained with plain
cross-entropy (same network plus a linear head), (c) the same encoder trained
with a flashcl loss; the k-nearest-neighbour accuracy (k = 5, cosine) of each
embedding on the held-out split is printed, and a PCA plot of the three
embeddings is written as a PNG.
"""

from __future__ import annotations

import argparse
import time
from typing import Callable, Dict

import torch
import torch.nn.functional as F
from torch import nn

import flashcl


def load(seed: int):
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    xtr, xte, ytr, yte = train_test_split(x / 16.0, y, test_size=0.3, random_state=seed, stratify=y)
    as_t = lambda a, dt: torch.tensor(a, dtype=dt)  # noqa: E731
    return as_t(xtr, torch.float32), as_t(xte, torch.float32), as_t(ytr, torch.long), as_t(yte, torch.long)


def augment(x: torch.Tensor) -> torch.Tensor:
    """A random shift of up to one pixel and a little noise."""
    dx, dy = torch.randint(-1, 2, (2,))
    img = torch.roll(x.view(-1, 1, 8, 8), shifts=(int(dx), int(dy)), dims=(2, 3))
    return (img.reshape(-1, 64) + 0.05 * torch.randn_like(x)).clamp(0, 1)


def encoder() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 64))


def knn_accuracy(train: torch.Tensor, ytr: torch.Tensor, test: torch.Tensor, yte: torch.Tensor, k: int = 5) -> float:
    sims = F.normalize(test, dim=1) @ F.normalize(train, dim=1).T
    pred = ytr[sims.topk(k, dim=1).indices].mode(dim=1).values
    return float((pred == yte).float().mean())


def train(
    step_loss: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor], params, xtr, ytr, epochs: int, desc: str
) -> None:
    opt = torch.optim.Adam(params, lr=1e-3)
    try:
        from tqdm import trange
    except ImportError:
        trange = range  # type: ignore[assignment]
    bar = trange(epochs, desc=desc, leave=False) if trange is not range else range(epochs)
    for _ in bar:
        perm = torch.randperm(len(xtr))
        for i in range(0, len(xtr), 256):
            idx = perm[i : i + 256]
            loss = step_loss(None, xtr[idx], ytr[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()


def main() -> Dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--loss", choices=["supcon", "nt_xent"], default="supcon")
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--fast", action="store_true", help="60 epochs")
    p.add_argument("--temperature", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="digits_embedding.png", help="PCA plot of the embeddings (PNG)")
    args = p.parse_args()
    epochs = 60 if args.fast else args.epochs
    torch.manual_seed(args.seed)
    t0 = time.time()
    xtr, xte, ytr, yte = load(args.seed)

    contrastive = encoder()

    def contrastive_loss(_, x, y):
        a, b = contrastive(augment(x)), contrastive(augment(x))
        if args.loss == "supcon":
            return flashcl.supcon_loss(torch.stack([a, b], 1), y, temperature=args.temperature)
        return flashcl.nt_xent_loss(a, b, temperature=args.temperature)

    train(contrastive_loss, contrastive.parameters(), xtr, ytr, epochs, args.loss)

    ce_encoder, head = encoder(), nn.Linear(64, 10)
    train(
        lambda _, x, y: F.cross_entropy(head(F.relu(ce_encoder(augment(x)))), y),
        list(ce_encoder.parameters()) + list(head.parameters()),
        xtr,
        ytr,
        epochs,
        "cross-entropy",
    )

    with torch.no_grad():
        embeddings = {
            "raw pixels": (xtr, xte),
            "cross-entropy encoder": (ce_encoder(xtr), ce_encoder(xte)),
            f"{args.loss} encoder": (contrastive(xtr), contrastive(xte)),
        }
        acc = {name: knn_accuracy(tr, ytr, te, yte) for name, (tr, te) in embeddings.items()}
    print("k-NN accuracy (k=5, cosine) on the held-out 30%: " + ", ".join(f"{name} {a:.4f}" for name, a in acc.items()))
    print(f"({epochs} epochs, {time.time() - t0:.1f} s)")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return acc
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.6))
    for ax, (name, (_, te)) in zip(axes, embeddings.items()):
        z = F.normalize(te, dim=1)
        z = z - z.mean(0)
        _, _, v = torch.pca_lowrank(z, q=2, center=False)
        xy = z @ v[:, :2]
        sc = ax.scatter(xy[:, 0], xy[:, 1], c=yte, cmap="tab10", s=6)
        ax.set_title(f"{name}: k-NN {acc[name]:.3f}")
        ax.set_xticks([])
        ax.set_yticks([])
    fig.colorbar(sc, ax=axes, ticks=range(10), label="digit")
    fig.suptitle("held-out digits, PCA of the normalised embedding")
    fig.savefig(args.out, dpi=90)
    print(f"wrote {args.out}")
    return acc


if __name__ == "__main__":
    main()
