"""flashcl.integrations.sentence_transformers against sentence-transformers'
own losses: equal values and gradients on random embeddings for every
configuration flashcl computes, the fallback (with its warning) for the others,
GradCache's cached gradients, and training through SentenceTransformerTrainer
with a tiny BERT built here (no download)."""

from __future__ import annotations

import warnings
from typing import Any, Dict, List

import pytest
import torch
from torch import nn

st = pytest.importorskip("sentence_transformers", reason="sentence-transformers is not installed")
try:  # sentence-transformers >= 6 (the top-level ``losses`` is a deprecated alias there)
    from sentence_transformers.sentence_transformer import losses as st_losses  # noqa: E402
except ImportError:  # pragma: no cover
    from sentence_transformers import losses as st_losses  # noqa: E402
from sentence_transformers.util import cos_sim, dot_score  # noqa: E402

import flashcl  # noqa: E402
from flashcl.integrations import sentence_transformers as fst  # noqa: E402
from helpers import TOL, assert_close, close_group, init_gloo, spawn  # noqa: E402

ALL_DIRECTIONS = ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")
CONFIGS: List[Dict[str, Any]] = [
    {},
    {"scale": 7.0},
    {"similarity_fct": dot_score, "scale": 1.0},
    {"directions": ("query_to_doc", "doc_to_query"), "partition_mode": "per_direction"},
    {"directions": ("query_to_doc", "doc_to_query"), "partition_mode": "joint"},
    {
        "directions": ("query_to_doc", "doc_to_query"),
        "partition_mode": "joint",
        "similarity_fct": dot_score,
        "scale": 0.5,
    },
    {"directions": ("query_to_doc", "query_to_query")},
    {"directions": ("query_to_doc", "doc_to_doc")},
    {"directions": ALL_DIRECTIONS, "partition_mode": "joint"},
    {"directions": ALL_DIRECTIONS, "scale": 5.0, "similarity_fct": dot_score},
    {"hardness_mode": "in_batch_negatives", "hardness_strength": 9.0},
    {"hardness_mode": "hard_negatives", "hardness_strength": 5.0},
    {"hardness_mode": "all_negatives", "hardness_strength": 3.0, "similarity_fct": dot_score, "scale": 2.0},
    {"hardness_mode": "in_batch_negatives", "hardness_strength": 9.0, "directions": ALL_DIRECTIONS},
]


def _columns(b: int, d: int, negatives: int, seed: int = 0) -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, d, generator=g, dtype=torch.float64) for _ in range(2 + negatives)]


def _value_and_grads(loss_fn: Any, columns: List[torch.Tensor]) -> tuple:
    leaves = [c.clone().requires_grad_(True) for c in columns]
    value = loss_fn.compute_loss_from_embeddings(leaves, None)
    grads = torch.autograd.grad(value, leaves)
    return value.detach(), grads


@pytest.mark.parametrize("negatives", [0, 1, 3])
@pytest.mark.parametrize(
    "config", CONFIGS, ids=lambda c: ",".join(f"{k}={getattr(v, '__name__', v)}" for k, v in c.items()) or "default"
)
@pytest.mark.parametrize("backend", ["dense", "tiled"])
def test_mnrl_equals_sentence_transformers(config: Dict[str, Any], negatives: int, backend: str) -> None:
    columns = _columns(11, 8, negatives)
    ours = fst.MultipleNegativesRankingLoss(None, backend=backend, block_size=4, **config)
    theirs = st_losses.MultipleNegativesRankingLoss(None, **config)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a supported configuration must not fall back
        v, g = _value_and_grads(ours, columns)
    v_ref, g_ref = _value_and_grads(theirs, columns)
    assert_close(v, v_ref, f"{config}: loss", 1e-10, 1e-10)
    for i, (a, e) in enumerate(zip(g, g_ref)):
        assert_close(a, e, f"{config}: grad of column {i}", 1e-10, 1e-10)


@pytest.mark.parametrize(
    "config",
    [
        {"similarity_fct": lambda a, b: -torch.cdist(a, b)},
    ],
)
def test_mnrl_unsupported_configurations_fall_back_with_a_warning(config: Dict[str, Any]) -> None:
    columns = _columns(9, 5, 1, seed=1)
    ours = fst.MultipleNegativesRankingLoss(None, **config)
    with pytest.warns(UserWarning, match="sentence-transformers' own implementation"):
        v, g = _value_and_grads(ours, columns)
    v_ref, g_ref = _value_and_grads(st_losses.MultipleNegativesRankingLoss(None, **config), columns)
    assert_close(v, v_ref, "fallback loss", 1e-12, 1e-12)
    for a, e in zip(g, g_ref):
        assert_close(a, e, "fallback grad", 1e-12, 1e-12)


def test_mnrl_rejects_a_single_column() -> None:
    with pytest.raises(ValueError, match="at least 2"):
        fst.MultipleNegativesRankingLoss(None).compute_loss_from_embeddings([torch.randn(4, 3)], None)


# ---------------------------------------------------------------- a tiny model, no download

WORDS = (
    "the a cat dog sat ran on mat park fast slow red blue car bus road stock market price fell rose "
    "team won lost game goal rain snow cold warm sun"
).split()


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import BertConfig, BertModel, BertTokenizerFast

    path = tmp_path_factory.mktemp("tiny_bert")
    vocab = path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + WORDS) + "\n")
    torch.manual_seed(0)
    BertModel(
        BertConfig(
            vocab_size=5 + len(WORDS),
            hidden_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=32,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
    ).save_pretrained(path)
    tokens = vocab.read_text().split()
    try:  # transformers >= 5 takes the vocabulary itself; 4.x a vocab file
        tokenizer = BertTokenizerFast(vocab={w: i for i, w in enumerate(tokens)})
    except TypeError:  # pragma: no cover
        tokenizer = BertTokenizerFast(vocab_file=str(vocab))
    assert tokenizer("cat dog")["input_ids"][1:3] == [tokens.index("cat"), tokens.index("dog")]
    tokenizer.save_pretrained(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no sentence-transformers model found: mean pooling"
        return path


def _load(path: Any) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return st.SentenceTransformer(str(path), device="cpu")


def _sentences(n: int, seed: int) -> List[str]:
    g = torch.Generator().manual_seed(seed)
    return [" ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (5,), generator=g)) for _ in range(n)]


def _param_grads(model: Any) -> List[torch.Tensor]:
    return [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize(
    "config", [{}, {"directions": ("query_to_doc", "doc_to_query"), "partition_mode": "per_direction"}]
)
def test_cached_mnrl_equals_sentence_transformers_through_a_model(tiny_model: Any, config: Dict[str, Any]) -> None:
    texts = [_sentences(10, s) for s in (1, 2, 3)]  # anchor, positive, negative
    grads = []
    values = []
    for cls in (fst.CachedMultipleNegativesRankingLoss, st_losses.CachedMultipleNegativesRankingLoss):
        model = _load(tiny_model)
        features = [model.tokenize(t) for t in texts]
        loss = cls(model, mini_batch_size=4, **config)
        value = loss(features, None)
        value.backward()
        values.append(value.detach())
        grads.append(_param_grads(model))
    assert_close(values[0], values[1], "cached loss", 1e-5, 1e-5)
    assert len(grads[0]) == len(grads[1]) > 0
    for a, e in zip(*grads):
        # float32 through a transformer's backward: error relative to the tensor's largest entry
        assert_close(a, e, "cached: parameter gradient", 1e-4 * float(e.abs().max()) + 1e-7, 1e-4)


def test_mnrl_and_supcon_train_with_sentence_transformer_trainer(tiny_model: Any, tmp_path: Any) -> None:
    datasets = pytest.importorskip("datasets", reason="datasets (sentence-transformers[train]) is not installed")
    from sentence_transformers import SentenceTransformerTrainer, SentenceTransformerTrainingArguments

    def train(loss_of: Any, data: Dict[str, List[Any]], seed: int = 0) -> Any:
        model = _load(tiny_model)
        args = SentenceTransformerTrainingArguments(
            output_dir=str(tmp_path / "run"),
            num_train_epochs=2,
            per_device_train_batch_size=8,
            learning_rate=1e-3,
            seed=seed,
            report_to=[],
            save_strategy="no",
            logging_steps=1000,
            use_cpu=True,
            dataloader_drop_last=True,
        )
        trainer = SentenceTransformerTrainer(
            model=model, args=args, train_dataset=datasets.Dataset.from_dict(data), loss=loss_of(model)
        )
        trainer.train()
        return model

    pairs = {"anchor": _sentences(32, 4), "positive": _sentences(32, 5)}
    ours = train(lambda m: fst.MultipleNegativesRankingLoss(m), pairs)
    theirs = train(lambda m: st_losses.MultipleNegativesRankingLoss(m), pairs)
    for (name, a), (_, e) in zip(ours.named_parameters(), theirs.named_parameters()):
        assert_close(a.detach(), e.detach(), f"after training: {name}", 1e-4, 1e-3)

    # labelled SupCon: two topics of sentences; training pulls same-topic texts together
    topic = [["cat", "dog", "sat", "mat", "park"], ["stock", "market", "price", "fell", "rose"]]
    g = torch.Generator().manual_seed(7)
    texts, labels = [], []
    for i in range(48):
        words = topic[i % 2] + ["the", "a", "red", "blue", "sun"]
        texts.append(" ".join(words[int(j)] for j in torch.randint(0, len(words), (6,), generator=g)))
        labels.append(i % 2)
    lab = torch.tensor(labels)

    def supcon_of(model: Any) -> float:
        with torch.no_grad():
            e = model.encode(texts, convert_to_tensor=True)
        return float(flashcl.supcon_loss(e, lab, temperature=0.1))

    before = supcon_of(_load(tiny_model))
    trained = train(lambda m: fst.SupConLoss(m, temperature=0.1), {"text": texts, "label": labels})
    after = supcon_of(trained)
    assert after < before - 0.1, (before, after)


def test_supcon_loss_module_is_flashcl_supcon_on_the_model_embeddings(tiny_model: Any) -> None:
    model = _load(tiny_model)
    texts = _sentences(12, 9)
    labels = torch.tensor([0, 1, 2] * 4)
    loss = fst.SupConLoss(model, temperature=0.2, positives="sum", include_self=True)
    value = loss([model.tokenize(texts)], labels)
    emb = model(model.tokenize(texts))["sentence_embedding"]
    expected = flashcl.supcon_loss(emb, labels, temperature=0.2, positives="sum", include_self=True)
    assert_close(value.detach(), expected.detach(), "SupConLoss module", 1e-6, 1e-6)
    with pytest.raises(ValueError, match="one text column"):
        loss([model.tokenize(texts), model.tokenize(texts)], labels)


def test_supcon_unknown_option_is_refused() -> None:
    with pytest.raises(ValueError):
        fst.SupConLoss(None, positives="max").compute_loss_from_embeddings(
            torch.randn(4, 3), torch.tensor([0, 0, 1, 1])
        )


def test_cos_sim_is_what_normalize_means() -> None:
    # the adapter's cos_sim branch is flashcl's normalize=True: the similarity itself agrees
    a, b = torch.randn(5, 4, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)
    ours = torch.nn.functional.normalize(a, dim=1) @ torch.nn.functional.normalize(b, dim=1).T
    assert_close(cos_sim(a, b), ours, "cos_sim", 1e-12, 1e-12)


# ---------------------------------------------------------------- GISTEmbed with a guide model


def _guide(path: Any, seed: int, max_seq_length: Any = None) -> Any:
    guide = _load(path)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # another model than the one trained, same tokenizer
        for p in guide.parameters():
            p.add_(0.5 * p.std().nan_to_num() * torch.randn(p.shape, generator=g))
    if max_seq_length is not None:
        guide.max_seq_length = max_seq_length  # shorter: sentence-transformers re-tokenises for the guide
    return guide


@pytest.mark.parametrize("columns", [2, 3])
@pytest.mark.parametrize(
    "config",
    [
        {},
        {"margin": 0.05, "margin_strategy": "relative", "contrast_anchors": False},
        {"retokenize": True, "temperature": 0.05},
    ],
)
@pytest.mark.parametrize("cached", [False, True])
def test_gist_losses_equal_sentence_transformers_through_a_model(
    tiny_model: Any, config: Dict[str, Any], columns: int, cached: bool
) -> None:
    config = dict(config)
    short = 16 if config.pop("retokenize", False) else None
    texts = [_sentences(10, s) for s in (11, 12, 13)][:columns]
    ours_cls = fst.CachedGISTEmbedLoss if cached else fst.GISTEmbedLoss
    theirs_cls = st_losses.CachedGISTEmbedLoss if cached else st_losses.GISTEmbedLoss
    extra = {"mini_batch_size": 4} if cached else {}
    values, grads = [], []
    for cls in (ours_cls, theirs_cls):
        # float64: a random tiny BERT's embeddings are all alike (cosines near 1), and in
        # float32 the guide's comparisons with the threshold would be decided by rounding
        model = _load(tiny_model).double()
        loss = cls(model, _guide(tiny_model, 3, short).double(), **config, **extra)
        assert loss.must_retokenize == (short is not None)
        with warnings.catch_warnings():
            warnings.simplefilter("error" if cls is ours_cls else "ignore")  # flashcl must not fall back
            value = loss([model.tokenize(t) for t in texts], None)
        value.backward()
        values.append(value.detach())
        grads.append(_param_grads(model))
    assert_close(values[0], values[1], "GIST loss", 1e-10, 1e-10)
    assert len(grads[0]) == len(grads[1]) > 0
    for a, e in zip(*grads):
        assert_close(a, e, "GIST: parameter gradient", 1e-9 * float(e.abs().max()) + 1e-12, 1e-8)


# ---------------------------------------------------------------- gather_across_devices on 2 processes


def _gather_worker(rank: int, world: int, out_dir: str) -> None:
    import datetime
    import os

    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"file://{os.path.join(out_dir, 'rendezvous')}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )
    torch.set_num_threads(1)
    results = {}
    columns = _columns(2 * 7, 6, 1, seed=21)
    local = [c[7 * rank : 7 * rank + 7] for c in columns]
    for i, config in enumerate(GATHER_CONFIGS):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # flashcl computes it: no fallback
            ours = _value_and_grads(
                fst.MultipleNegativesRankingLoss(
                    None, gather_across_devices=True, backend="tiled", block_size=3, **config
                ),
                local,
            )
        theirs = _value_and_grads(
            st_losses.MultipleNegativesRankingLoss(None, gather_across_devices=True, **config), local
        )
        results[i] = (ours, theirs)
        # the cached variants' loss over the mini-batches' embeddings
        cached = []
        for cls in (fst.CachedMultipleNegativesRankingLoss, st_losses.CachedMultipleNegativesRankingLoss):
            leaves = [c.clone().requires_grad_(True) for c in local]
            with warnings.catch_warnings():
                warnings.simplefilter("error" if cls is fst.CachedMultipleNegativesRankingLoss else "ignore")
                loss_fn = cls(nn.Sequential(nn.Identity()), gather_across_devices=True, mini_batch_size=3, **config)
                value = loss_fn.calculate_loss([list(x.split(3)) for x in leaves])
            cached.append((value.detach(), list(torch.autograd.grad(value, leaves))))
        results[f"cached-{i}"] = tuple(cached)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    close_group()


GIST_GATHER_CONFIGS: List[Dict[str, Any]] = [
    {"columns": 2},
    {"columns": 3, "margin": 0.05, "margin_strategy": "relative", "contrast_anchors": False},
    {"columns": 4, "temperature": 0.05, "contrast_positives": False},
    {"columns": 3, "margin": 0.1},
    # the backends the gathered form takes: tiled blocks across the gathered candidates; the
    # per-row oracle has no gathered form, so "reference" is the dense form
    {"columns": 3, "backend": "tiled", "block_size": 3},
    {"columns": 2, "backend": "reference"},
]


def _bare(cls: Any, **attrs: Any) -> Any:
    """An instance made without ``__init__`` (no models), as sentence-transformers'
    own tests make them, with the loss's attributes set."""
    obj = cls.__new__(cls)
    nn.Module.__init__(obj)
    defaults = dict(temperature=0.01, margin=0.0, margin_strategy="absolute", contrast_anchors=True)
    defaults.update(contrast_positives=True, mini_batch_size=3, show_progress_bar=False)
    for k, v in {**defaults, **attrs, "gather_across_devices": True}.items():
        setattr(obj, k, v)
    obj.similarity_fct = nn.CosineSimilarity(dim=-1)
    obj.cross_entropy_loss = nn.CrossEntropyLoss()
    return obj


def _gist_gather_worker(rank: int, world: int, out_dir: str) -> None:
    import os

    from helpers import init_gloo

    init_gloo(rank, world, out_dir)
    torch.set_num_threads(1)
    results = {}
    for i, config in enumerate(GIST_GATHER_CONFIGS):
        config = dict(config)
        n = config.pop("columns")
        # guides close to the model's embeddings: some in-batch candidates are false negatives
        columns = _columns(2 * 5, 6, n - 2, seed=31 + i)
        g = torch.Generator().manual_seed(41 + i)
        guides = [c[:, :4] + 0.3 * torch.randn(10, 4, generator=g, dtype=torch.float64) for c in columns]
        local = [c[5 * rank : 5 * rank + 5] for c in columns]
        local_guides = [c[5 * rank : 5 * rank + 5] for c in guides]
        out = []
        for cls in (fst.CachedGISTEmbedLoss, st_losses.CachedGISTEmbedLoss, fst.GISTEmbedLoss):
            if cls is fst.GISTEmbedLoss and n > 3:
                continue
            loss = _bare(cls, **config)
            leaves = [c.clone().requires_grad_(True) for c in local]
            with warnings.catch_warnings():
                warnings.simplefilter("error" if cls is not st_losses.CachedGISTEmbedLoss else "ignore")
                if cls is fst.GISTEmbedLoss:
                    value = loss.compute_loss_from_embeddings(leaves, local_guides)
                else:
                    value = loss.calculate_loss(
                        [list(x.split(3)) for x in leaves], [list(x.split(3)) for x in local_guides]
                    )
            out.append((value.detach(), list(torch.autograd.grad(value, leaves))))
        results[i] = out
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    close_group()


def test_gist_gather_across_devices_equals_sentence_transformers(tmp_path: Any) -> None:
    """gather_across_devices=True on 2 processes: this process's anchors against every
    process's positives and negatives (the anchors' own candidates local), each rank's
    value and the gradient of every column equal to sentence-transformers' own, for
    GISTEmbedLoss and CachedGISTEmbedLoss; no fallback."""

    spawn(_gist_gather_worker, args=(2, str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        results = torch.load(tmp_path / f"rank{rank}.pt")
        for i, out in results.items():
            (v_ref, g_ref) = out[1]
            for name, (v, g) in zip(("cached", "", "plain"), out):
                if name == "":
                    continue
                what = f"rank {rank}, {name} {GIST_GATHER_CONFIGS[i]}"
                assert_close(v, v_ref, f"{what}: loss", 1e-10, 1e-10)
                for j, (a, e) in enumerate(zip(g, g_ref)):
                    assert_close(a, e, f"{what}: grad of column {j}", 1e-10, 1e-10)


GATHER_CONFIGS: List[Dict[str, Any]] = [
    {},
    {"directions": ALL_DIRECTIONS},
    {"directions": ("query_to_doc", "doc_to_query"), "partition_mode": "per_direction"},
    {"hardness_mode": "hard_negatives", "hardness_strength": 5.0},
    {"hardness_mode": "in_batch_negatives", "hardness_strength": 9.0, "similarity_fct": dot_score, "scale": 1.0},
]


def test_mnrl_gather_across_devices_equals_sentence_transformers(tmp_path: Any) -> None:

    spawn(_gather_worker, args=(2, str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        results = torch.load(tmp_path / f"rank{rank}.pt")
        for i, ((v, g), (v_ref, g_ref)) in results.items():
            what = f"rank {rank}, {i}: {GATHER_CONFIGS[int(str(i).split('-')[-1])]}"
            assert_close(v, v_ref, f"{what}: loss", 1e-10, 1e-10)
            for j, (a, e) in enumerate(zip(g, g_ref)):
                assert_close(a, e, f"{what}: grad of column {j}", 1e-10, 1e-10)


# ---------------------------------------------------------------- MatryoshkaLoss


@pytest.mark.parametrize("cached", [False, True])
@pytest.mark.parametrize(
    "setup",
    [
        {"dims": [32, 16, 8], "config": {}},
        {"dims": [32, 24, 4], "weights": [1.0, 0.5, 2.0], "config": {"directions": ("query_to_doc", "doc_to_query")}},
        {
            "dims": [32, 16, 8, 4],
            "n_dims_per_step": 2,
            "config": {"hardness_mode": "in_batch_negatives", "hardness_strength": 9.0},
        },
    ],
)
def test_matryoshka_equals_sentence_transformers(
    tiny_model: Any, setup: Dict[str, Any], cached: bool, monkeypatch: Any
) -> None:
    """flashcl's MatryoshkaLoss (all widths in one pass), sentence-transformers'
    MatryoshkaLoss around flashcl's MNRL (one flashcl call per width), and
    sentence-transformers' own, through a model's parameter gradients (float64)."""
    import random

    from flashcl.engine import matryoshka

    one_pass_calls = []
    original = matryoshka.head_values

    def spy(*args: Any, **kwargs: Any) -> Any:
        one_pass_calls.append(args[6])  # the widths
        return original(*args, **kwargs)

    monkeypatch.setattr(matryoshka, "head_values", spy)

    texts = [_sentences(10, s) for s in (31, 32, 33)]  # anchor, positive, negative
    st_mnrl = st_losses.CachedMultipleNegativesRankingLoss if cached else st_losses.MultipleNegativesRankingLoss
    our_mnrl = fst.CachedMultipleNegativesRankingLoss if cached else fst.MultipleNegativesRankingLoss
    extra = {"mini_batch_size": 4} if cached else {}
    kw = {"matryoshka_weights": setup.get("weights"), "n_dims_per_step": setup.get("n_dims_per_step", -1)}
    values, grads = [], []
    for wrapper, inner in (
        (fst.MatryoshkaLoss, our_mnrl),
        (st_losses.MatryoshkaLoss, our_mnrl),
        (st_losses.MatryoshkaLoss, st_mnrl),
    ):
        model = _load(tiny_model).double()
        loss = wrapper(model, inner(model, **setup["config"], **extra), setup["dims"], **kw)
        random.seed(0)  # n_dims_per_step draws its widths with Python's random
        with warnings.catch_warnings():
            warnings.simplefilter("error" if inner is our_mnrl else "ignore")  # no fallback in flashcl's
            value = loss([model.tokenize(t) for t in texts], None)
        value.backward()
        values.append(value.detach())
        grads.append(_param_grads(model))
        if wrapper is fst.MatryoshkaLoss:  # every width of the step in each one-pass call
            n = setup.get("n_dims_per_step", len(setup["dims"]))
            assert one_pass_calls and all(len(w) == n for w in one_pass_calls), one_pass_calls
            one_pass_calls.clear()
    assert not one_pass_calls, "sentence-transformers' MatryoshkaLoss calls the inner loss once per width"
    for i in (0, 1):
        assert_close(values[i], values[2], f"Matryoshka loss ({i})", 1e-10, 1e-10)
        assert len(grads[i]) == len(grads[2]) > 0
        for a, e in zip(grads[i], grads[2]):
            assert_close(a, e, f"Matryoshka parameter gradient ({i})", 1e-9 * float(e.abs().max()) + 1e-12, 1e-8)


@pytest.mark.parametrize("backend", ["dense", "tiled"])
def test_gist_float32_gradients_no_worse_than_sentence_transformers(tiny_model: Any, backend: str) -> None:
    """Parameter gradients in float32 against float64, beside sentence-transformers'
    own float32 code (at GIST's default temperature 0.01, where a random tiny BERT's
    embeddings are all alike and the gradient is a difference of nearly equal
    terms); the guide in float64 so that both filter the same candidates.

    The project's rule for a fast path, ``err <= err_peer + tol[float32]`` (relative to
    the gradient's largest entry). Measured: parameter gradients 1.3e-5 (dense) and
    4.8e-5 (tiled) from float64 against sentence-transformers' 1.0e-5 (largest entry
    4.0); at the embeddings, 2.2e-6 against 1.1e-6 (each candidate set is its own
    softmax and the positive its own term, where sentence-transformers forms one
    matrix)."""
    texts = [_sentences(10, s) for s in (11, 12)]

    def grads(cls: Any, dtype: torch.dtype, **kw: Any) -> List[torch.Tensor]:
        model = _load(tiny_model).to(dtype)
        loss = cls(model, _guide(tiny_model, 3).double(), **kw)
        loss([model.tokenize(t) for t in texts], None).backward()
        return _param_grads(model)

    exact = grads(st_losses.GISTEmbedLoss, torch.float64)
    theirs = grads(st_losses.GISTEmbedLoss, torch.float32)
    ours = grads(fst.GISTEmbedLoss, torch.float32, backend=backend)
    flat = torch.cat([e.reshape(-1) for e in exact])
    err_theirs, err_ours = (
        float((torch.cat([g.reshape(-1) for g in x]).double() - flat).abs().max()) for x in (theirs, ours)
    )
    atol, _ = TOL[torch.float32]
    assert err_ours <= err_theirs + atol * float(flat.abs().max()), (err_ours, err_theirs)


@pytest.mark.parametrize(
    "cls",
    [
        fst.MultipleNegativesRankingLoss,
        fst.CachedMultipleNegativesRankingLoss,
        fst.GISTEmbedLoss,
        fst.CachedGISTEmbedLoss,
    ],
)
def test_adapters_made_without_init_have_flashcl_defaults(cls: Any) -> None:
    """sentence-transformers' own tests make losses with ``cls.__new__(cls)``."""
    loss = cls.__new__(cls)
    assert loss.backend == "auto" and loss.block_size is None


@pytest.mark.parametrize("name, columns", [("CoSENTLoss", 2), ("AnglELoss", 2), ("AnglELoss", 3)])
def test_cosent_and_angle_equal_sentence_transformers(name: str, columns: int) -> None:
    g = torch.Generator().manual_seed(4)
    embeddings = [torch.randn(10, 6, dtype=torch.float64, generator=g) for _ in range(columns)]
    labels = None if columns == 3 else torch.randint(0, 5, (10,), generator=g).double() / 4
    grads, values = [], []
    for cls in (getattr(fst, name), getattr(st_losses, name)):
        xs = [e.clone().requires_grad_(True) for e in embeddings]
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # flashcl computes every case here: no fallback warning
            value = cls(None, scale=13.0).compute_loss_from_embeddings(xs, labels)
        values.append(value.detach())
        grads.append(torch.autograd.grad(value, xs))
    assert_close(values[0], values[1], f"{name}: value", *TOL[torch.float64])
    for i, (a, e) in enumerate(zip(*grads)):
        assert_close(a, e, f"{name}: grad {i}", *TOL[torch.float64])


def test_cosent_other_similarity_falls_back_with_a_warning() -> None:
    from sentence_transformers.util import pairwise_dot_score

    a, b, y = torch.randn(8, 4), torch.randn(8, 4), torch.rand(8)
    ours = fst.CoSENTLoss(None, similarity_fct=pairwise_dot_score)
    with pytest.warns(UserWarning, match="similarity_fct='pairwise_dot_score'"):
        got = ours.compute_loss_from_embeddings([a, b], y)
    want = st_losses.CoSENTLoss(None, similarity_fct=pairwise_dot_score).compute_loss_from_embeddings([a, b], y)
    assert_close(got, want, "fallback value", *TOL[torch.float32])
    with pytest.raises(ValueError, match="labels"):
        fst.CoSENTLoss(None).compute_loss_from_embeddings([a, b], torch.rand(7))


def test_cosent_trains_through_a_model(tiny_model: Any) -> None:
    texts = [_sentences(12, s) for s in (5, 6)]
    labels = torch.rand(12, generator=torch.Generator().manual_seed(0))
    grads, values = [], []
    for cls in (fst.CoSENTLoss, st_losses.CoSENTLoss):
        model = _load(tiny_model)
        value = cls(model)([model.tokenize(t) for t in texts], labels)
        value.backward()
        values.append(value.detach())
        grads.append(_param_grads(model))
    assert_close(values[0], values[1], "CoSENT through a model", 1e-5, 1e-5)
    assert len(grads[0]) == len(grads[1]) > 0
    for a, e in zip(*grads):
        assert_close(a, e, "CoSENT: parameter gradient", 1e-4 * float(e.abs().max()) + 1e-7, 1e-4)


def _make(cls: Any, tiny: Any, **kw: Any) -> Any:
    """A drop-in with the model it needs (GIST: a guide too)."""
    if "GIST" in cls.__name__:
        return cls(tiny, tiny, **kw)
    return cls(tiny, **kw)


DROP_INS = [
    fst.MultipleNegativesRankingLoss,
    fst.CachedMultipleNegativesRankingLoss,
    fst.GISTEmbedLoss,
    fst.CachedGISTEmbedLoss,
    fst.CoSENTLoss,
    fst.AnglELoss,
    fst.BatchAllTripletLoss,
    fst.BatchHardTripletLoss,
    fst.BatchSemiHardTripletLoss,
    fst.BatchHardSoftMarginTripletLoss,
    fst.SupConLoss,
]


@pytest.mark.parametrize("cls", DROP_INS, ids=lambda c: c.__name__)
def test_drop_ins_check_flashcl_options_when_made_and_record_them(cls: Any, tiny_model: Any) -> None:
    """A bad backend or block_size is refused by the constructor (not at the first call:
    block_size=0 is not 'automatic', -1 not a raw RuntimeError); the options are in
    get_config_dict (the model card's and the saved training arguments' record)."""
    tiny_model = _load(tiny_model)
    takes_block = "block_size" in __import__("inspect").signature(cls.__init__).parameters
    with pytest.raises(ValueError, match="backend must be one of"):
        _make(cls, tiny_model, backend="fast")
    if takes_block:
        for bad in (0, -1, 2.5, True):
            with pytest.raises(ValueError, match="block_size must be a positive int"):
                _make(cls, tiny_model, block_size=bad)
    loss = _make(cls, tiny_model, backend="tiled", **({"block_size": 8} if takes_block else {}))
    config = loss.get_config_dict()
    assert config["backend"] == "tiled"
    assert config.get("block_size") == (8 if takes_block else None)
    peer = getattr(st_losses, cls.__name__, None)
    if peer is not None:  # the peer's own keys are kept
        theirs = _make(peer, tiny_model).get_config_dict()
        assert set(theirs) <= set(config), (set(theirs), set(config))


def test_a_soft_margin_triplet_loss_refuses_a_margin_as_sentence_transformers() -> None:
    with pytest.raises(TypeError):
        st_losses.BatchHardSoftMarginTripletLoss(None, margin=1.0)
    with pytest.raises(TypeError, match="margin"):
        fst.BatchHardSoftMarginTripletLoss(None, margin=1.0)
    import inspect

    theirs = inspect.signature(st_losses.BatchHardSoftMarginTripletLoss.__init__).parameters
    ours = inspect.signature(fst.BatchHardSoftMarginTripletLoss.__init__).parameters
    assert [p for p in ours if ours[p].kind != inspect.Parameter.KEYWORD_ONLY] == list(theirs)


# ---------------------------------------------------------------- the false-negative margin


def _mnrl_masked(columns: List[torch.Tensor], config: Dict[str, Any], margin: float) -> torch.Tensor:
    """MNRL with Qwen3-Embedding's mask written densely: in every selected direction, row i's
    terms whose similarity exceeds sim(q_i, d_i) + margin left out, the positive pair kept."""
    q, d, negs = columns[0], columns[1], columns[2:]
    scale = config.get("scale", 20.0)
    sim = config.get("similarity_fct", cos_sim)
    b = q.shape[0]
    d_all = torch.cat([d, *negs])
    pos = sim(q, d).diagonal()
    bar = (pos + margin).detach().unsqueeze(1)
    cols_all = torch.arange(d_all.shape[0]).unsqueeze(0)
    rows = torch.arange(b).unsqueeze(1)
    cols_q = torch.arange(b).unsqueeze(0)
    inf = float("-inf")
    terms = {
        "query_to_doc": (sim(q, d_all), (cols_all != rows) & (sim(q, d_all).detach() > bar)),
        "query_to_query": (sim(q, q), (cols_q == rows) | (sim(q, q).detach() > bar)),
        "doc_to_query": (sim(d, q), (cols_q != rows) & (sim(d, q).detach() > bar)),
        "doc_to_doc": (sim(d, d_all), (cols_all % b == rows) | (sim(d, d_all).detach() > bar)),
    }
    chosen = [terms[k] for k in ALL_DIRECTIONS if k in config.get("directions", ("query_to_doc",))]
    lses = [torch.logsumexp((scale * s).masked_fill(out, inf), 1) for s, out in chosen]
    if config.get("partition_mode", "joint") == "joint":
        log_z = torch.logsumexp(torch.stack(lses), 0)
    else:
        log_z = torch.stack(lses).mean(0)
    return (log_z - scale * pos).mean()


@pytest.mark.parametrize(
    "config",
    [
        {},
        {"scale": 7.0, "similarity_fct": dot_score},
        {"directions": ALL_DIRECTIONS},
        {"directions": ("query_to_doc", "doc_to_query"), "partition_mode": "per_direction"},
        {"directions": ("query_to_doc", "doc_to_doc"), "scale": 5.0},
    ],
    ids=lambda c: ",".join(f"{k}={getattr(v, '__name__', v)}" for k, v in c.items()) or "default",
)
@pytest.mark.parametrize("negatives", [0, 2])
@pytest.mark.parametrize("backend", ["dense", "tiled"])
def test_mnrl_false_negative_margin_equals_the_dense_mask(config: Dict[str, Any], negatives: int, backend: str):
    columns = _columns(11, 8, negatives, seed=4)
    columns[1] = columns[0] + 0.9 * columns[1]  # positives near their queries, some negatives above them
    margin = 0.05 if config.get("similarity_fct") is not dot_score else 0.5
    ours = fst.MultipleNegativesRankingLoss(None, false_negative_margin=margin, backend=backend, block_size=4, **config)
    v, g = _value_and_grads(ours, columns)
    leaves = [c.clone().requires_grad_(True) for c in columns]
    want = _mnrl_masked(leaves, config, margin)
    assert_close(v, want, f"{config}: loss", 1e-10, 1e-10)
    for i, (a, e) in enumerate(zip(g, torch.autograd.grad(want, leaves))):
        assert_close(a, e, f"{config}: grad of column {i}", 1e-10, 1e-10)
    # the mask leaves some pair out here; a margin above every score leaves none (sentence-transformers' value)
    assert not torch.allclose(v, _mnrl_masked(columns, config, 1e9))
    wide = fst.MultipleNegativesRankingLoss(None, false_negative_margin=1e9, backend=backend, **config)
    v_wide, _ = _value_and_grads(wide, columns)
    v_st, _ = _value_and_grads(st_losses.MultipleNegativesRankingLoss(None, **config), columns)
    assert_close(v_wide, v_st, f"{config}: no pair left out", 1e-10, 1e-10)


def test_mnrl_false_negative_margin_options_and_errors(tiny_model: Any) -> None:
    loss = fst.CachedMultipleNegativesRankingLoss(_load(tiny_model), false_negative_margin=0.1)
    assert loss.get_config_dict()["false_negative_margin"] == 0.1
    assert fst.MultipleNegativesRankingLoss(None).get_config_dict()["false_negative_margin"] is None
    for kw, match in (
        ({"false_negative_margin": float("nan")}, "finite"),
        ({"false_negative_margin": "0.1"}, "finite"),
        ({"false_negative_margin": 0.1, "hardness_mode": "all_negatives", "hardness_strength": 2.0}, "hardness"),
        ({"false_negative_margin": 0.1, "backend": "triton"}, "Triton"),
        ({"false_negative_margin": 0.1, "similarity_fct": lambda a, b: -torch.cdist(a, b)}, "does not compute"),
    ):
        with pytest.raises(ValueError, match=match):
            fst.MultipleNegativesRankingLoss(None, **kw)
    # the cached loss and every Matryoshka width in one pass, against sentence-transformers' wrapper
    texts = [_sentences(10, s) for s in (41, 42, 43)]
    values, grads = [], []
    for wrapper, cached in ((fst.MatryoshkaLoss, False), (st_losses.MatryoshkaLoss, False), (None, True)):
        model = _load(tiny_model).double()
        if cached:
            inner = fst.CachedMultipleNegativesRankingLoss(model, mini_batch_size=4, false_negative_margin=0.02)
            value = inner([model.tokenize(t) for t in texts], None)
        else:
            inner = fst.MultipleNegativesRankingLoss(model, false_negative_margin=0.02, directions=ALL_DIRECTIONS)
            value = wrapper(model, inner, [32, 16, 8])([model.tokenize(t) for t in texts], None)
        value.backward()
        values.append(value.detach())
        grads.append(_param_grads(model))
    assert_close(values[0], values[1], "Matryoshka, one pass", 1e-10, 1e-10)
    for a, e in zip(grads[0], grads[1]):
        assert_close(a, e, "Matryoshka parameter gradient", 1e-9 * float(e.abs().max()) + 1e-12, 1e-8)
    model = _load(tiny_model).double()
    plain = fst.MultipleNegativesRankingLoss(model, false_negative_margin=0.02)
    assert_close(values[2], plain([model.tokenize(t) for t in texts], None), "cached", 1e-10, 1e-10)


def _margin_gather_worker(rank: int, world: int, out_dir: str) -> None:
    import os

    init_gloo(rank, world, out_dir)
    columns = _columns(2 * 7, 6, 1, seed=22)
    columns[1] = columns[0] + 0.9 * columns[1]
    local = [c[7 * rank : 7 * rank + 7] for c in columns]
    results = {}
    for i, config in enumerate(MARGIN_GATHER_CONFIGS):
        loss = fst.MultipleNegativesRankingLoss(
            None, gather_across_devices=True, false_negative_margin=0.05, backend="tiled", block_size=3, **config
        )
        results[i] = _value_and_grads(loss, local)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    close_group()


MARGIN_GATHER_CONFIGS: List[Dict[str, Any]] = [{}, {"directions": ALL_DIRECTIONS}]


def test_mnrl_false_negative_margin_across_devices(tmp_path: Any) -> None:
    """gather_across_devices with the margin: each rank's rows against every rank's
    candidates; the ranks' values and gradients add up to those of the dense mask on the
    concatenated batch (each rank's loss a mean over its half of the rows)."""
    spawn(_margin_gather_worker, args=(2, str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    columns = _columns(2 * 7, 6, 1, seed=22)
    columns[1] = columns[0] + 0.9 * columns[1]
    for i, config in enumerate(MARGIN_GATHER_CONFIGS):
        leaves = [c.clone().requires_grad_(True) for c in columns]
        want = 2 * _mnrl_masked(leaves, config, 0.05)
        assert not torch.allclose(want, 2 * _mnrl_masked(columns, config, 1e9))  # the margin leaves pairs out
        grads = torch.autograd.grad(want, leaves)
        assert_close(ranks[0][i][0] + ranks[1][i][0], want, f"{config}: summed loss", 1e-10, 1e-10)
        for r in range(2):
            for j, g in enumerate(grads):
                got = ranks[r][i][1][j]
                assert_close(got, g[7 * r : 7 * r + 7], f"{config}: rank {r}, column {j}", 1e-10, 1e-10)
