"""flashcl.cached_step (GradCache) against a full-batch step: a small transformer
with dropout built here, float64; parameter gradients equal to one step over the
whole batch whose encoder runs chunk by chunk (the same dropout draws), on one
process and under DistributedDataParallel on 2 gloo processes; luyug's GradCache
where it is importable."""

from __future__ import annotations

import datetime
import os
from typing import Any, Callable, Dict, List, Tuple

import pytest
import torch
import torch.distributed as dist
from torch import nn

import flashcl
from flashcl.training.cached import split_batch
from helpers import assert_close, close_group, spawn

F64 = torch.float64
VOCAB, LENGTH = 40, 7


class TinyEncoder(nn.Module):
    """Token embeddings, one transformer layer with dropout, mean pooling over the mask."""

    def __init__(self, width: int = 16, seed: int = 0, dropout: float = 0.2) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(VOCAB, width)
        self.layer = nn.TransformerEncoderLayer(width, nhead=2, dim_feedforward=32, dropout=dropout, batch_first=True)
        self.proj = nn.Linear(width, width)
        self.double()

    def forward(self, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
        mask = batch["attention_mask"].to(F64)
        h = self.layer(self.embed(batch["input_ids"]), src_key_padding_mask=batch["attention_mask"] == 0)
        pooled = (h * mask.unsqueeze(-1)).sum(1) / mask.sum(1, keepdim=True)
        return self.proj(pooled)


def _texts(b: int, seed: int) -> Dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (b, LENGTH), generator=g)
    lengths = torch.randint(3, LENGTH + 1, (b,), generator=g)
    mask = (torch.arange(LENGTH).unsqueeze(0) < lengths.unsqueeze(1)).long()
    return {"input_ids": ids * mask, "attention_mask": mask}


def _grads(*modules: nn.Module) -> List[torch.Tensor]:
    return [p.grad.detach().clone() for m in modules for p in m.parameters() if p.grad is not None]


def _full_batch_step(
    encoders: List[nn.Module], inputs: List[Any], loss_fn: Callable[..., torch.Tensor], chunk: int, **kw: Any
) -> torch.Tensor:
    """One step over the whole batch, the encoder run chunk by chunk with its graph."""
    embeddings = [torch.cat([enc(part) for part in split_batch(x, chunk)]) for enc, x in zip(encoders, inputs)]
    loss = loss_fn(*embeddings, **kw)
    loss.backward()
    return loss.detach()


def _compare(
    encoders: List[nn.Module],
    inputs: List[Any],
    loss_fn: Callable[..., torch.Tensor],
    chunk: int,
    extra: Tuple[nn.Parameter, ...] = (),
    **kw: Any,
) -> None:
    modules = list(dict.fromkeys(encoders))  # a shared encoder once
    for m in modules:
        m.zero_grad()
    for p in extra:
        p.grad = None
    torch.manual_seed(123)
    ref = _full_batch_step(encoders, inputs, loss_fn, chunk, **kw)
    ref_grads = _grads(*modules) + [p.grad.clone() for p in extra]
    ref_rng = torch.get_rng_state()
    for m in modules:
        m.zero_grad()
    for p in extra:
        p.grad = None
    torch.manual_seed(123)
    encoder_arg: Any = encoders if len(modules) > 1 else encoders[0]
    loss = flashcl.cached_step(encoder_arg, inputs, loss_fn, chunk_size=chunk, **kw)
    got = _grads(*modules) + [p.grad.clone() for p in extra]
    assert torch.equal(torch.get_rng_state(), ref_rng), "the step must leave the random state as a full step does"
    assert_close(loss, ref, "loss", 1e-12, 1e-12)
    assert len(got) == len(ref_grads) > 0
    for i, (a, e) in enumerate(zip(got, ref_grads)):
        assert_close(a, e, f"parameter {i}", 1e-11, 1e-9)


@pytest.mark.parametrize("chunk", [1, 5, 32])
def test_info_nce_two_towers_one_encoder(chunk: int) -> None:
    enc = TinyEncoder()
    _compare(
        [enc, enc],
        [_texts(23, 1), _texts(23, 2)],
        lambda q, d: flashcl.info_nce_loss(q, d, temperature=0.1, backend="tiled", block_size=6),
        chunk,
    )


def test_supcon_with_labels_passed_through() -> None:
    enc = TinyEncoder(seed=1)
    labels = torch.randint(0, 4, (19,), generator=torch.Generator().manual_seed(3))
    _compare(
        [enc],
        [_texts(19, 3)],
        lambda e, labels: flashcl.supcon_loss(e, labels, temperature=0.2, backend="tiled", block_size=4),
        chunk=4,
        labels=labels,
    )


def test_clip_two_encoders_and_a_learnable_scale() -> None:
    image, text = TinyEncoder(seed=2), TinyEncoder(seed=3, width=16)
    scale = nn.Parameter(torch.tensor(10.0, dtype=F64))
    _compare(
        [image, text],
        [_texts(17, 4), _texts(17, 5)],
        lambda a, b: flashcl.clip_loss(a, b, scale, backend="tiled", block_size=5),
        chunk=6,
        extra=(scale,),
    )


def test_hard_negatives_a_third_input_and_matryoshka() -> None:
    enc = TinyEncoder(seed=4)

    def loss_fn(q: torch.Tensor, pos: torch.Tensor, neg: torch.Tensor) -> torch.Tensor:
        return flashcl.info_nce_loss(q, torch.cat([pos, neg]), temperature=0.05, matryoshka_dims=[4, 8, 16])

    _compare([enc, enc, enc], [_texts(12, 6), _texts(12, 7), _texts(12, 8)], loss_fn, chunk=5)


def test_dropout_is_active_in_these_tests() -> None:
    # the replayed random state matters: two different seeds give different gradients
    enc = TinyEncoder()
    inputs = [_texts(10, 1), _texts(10, 2)]
    out = []
    for seed in (1, 2):
        enc.zero_grad()
        torch.manual_seed(seed)
        flashcl.cached_step(enc, inputs, lambda q, d: flashcl.info_nce_loss(q, d), chunk_size=4)
        out.append(_grads(enc))
    assert any(not torch.allclose(a, b) for a, b in zip(*out))


def test_encoder_output_key_and_a_scaler() -> None:
    enc = TinyEncoder(seed=5, dropout=0.0)

    class Dict_(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = enc

        def forward(self, batch: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
            return {"sentence_embedding": self.inner(batch)}

    class Scaler:
        def scale(self, loss: torch.Tensor) -> torch.Tensor:
            return loss * 8.0

    inputs = [_texts(9, 1), _texts(9, 2)]
    loss_fn = lambda q, d: flashcl.info_nce_loss(q, d)  # noqa: E731
    flashcl.cached_step(enc, inputs, loss_fn, chunk_size=4)
    plain = _grads(enc)
    enc.zero_grad()
    flashcl.cached_step(
        Dict_(), inputs, loss_fn, chunk_size=4, output=lambda out: out["sentence_embedding"], scaler=Scaler()
    )
    for a, e in zip(_grads(enc), plain):
        assert_close(a, 8.0 * e, "scaled gradient", 1e-12, 1e-10)


BAD = {
    "one tensor for inputs": (
        lambda enc: flashcl.cached_step(enc, torch.zeros(3, 4), lambda e: e.sum(), 2),
        TypeError,
        "one batch per tower",
    ),
    "chunk size 0": (
        lambda enc: flashcl.cached_step(enc, [torch.zeros(3, 4)], lambda e: e.sum(), 0),
        ValueError,
        "chunk_size",
    ),
    "encoder count": (
        lambda enc: flashcl.cached_step([enc, enc], [torch.zeros(3, 4)], lambda e: e.sum(), 2),
        ValueError,
        "encoders",
    ),
    "loss without the embeddings": (
        lambda enc: flashcl.cached_step(enc, [torch.zeros(3, 4)], lambda e: torch.zeros(()), 2),
        ValueError,
        "depends on the embeddings",
    ),
    "encoder output": (
        lambda enc: flashcl.cached_step(lambda x: {"x": x}, [torch.zeros(3, 4)], lambda e: e.sum(), 2),
        TypeError,
        "output=",
    ),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_input(name: str) -> None:
    call, exc, words = BAD[name]
    with pytest.raises(exc, match=words):
        call(nn.Linear(4, 2))


# ----------------------------------------------------------------------------- DDP


def _ddp_worker(rank: int, world: int, out_dir: str) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"file://{os.path.join(out_dir, 'rendezvous')}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )
    torch.set_num_threads(1)
    results: Dict[str, Any] = {}
    q_all, d_all = _texts(2 * 9, 11), _texts(2 * 9, 12)
    local = slice(9 * rank, 9 * rank + 9)
    q = {k: v[local] for k, v in q_all.items()}
    d = {k: v[local] for k, v in d_all.items()}
    loss_fn = lambda a, b: flashcl.info_nce_loss(a, b, temperature=0.1, process_group=dist.group.WORLD)  # noqa: E731
    for dropout in (0.0, 0.3):
        for cached in (False, True):
            enc = nn.parallel.DistributedDataParallel(TinyEncoder(seed=7, dropout=dropout))
            torch.manual_seed(100 + rank)
            if cached:
                flashcl.cached_step(enc, [q, d], loss_fn, chunk_size=4)
            else:
                _full_batch_step([enc, enc], [q, d], loss_fn, 4)
            results[f"{dropout}-{cached}"] = _grads(enc)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    del enc  # the DDP module holds the process group
    close_group()


def test_ddp_two_processes(tmp_path: Any) -> None:
    spawn(_ddp_worker, args=(2, str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    # without dropout: the single-process full-batch gradient of the global loss
    enc = TinyEncoder(seed=7, dropout=0.0)
    _full_batch_step(
        [enc, enc], [_texts(18, 11), _texts(18, 12)], lambda a, b: flashcl.info_nce_loss(a, b, temperature=0.1), 18
    )
    single = _grads(enc)
    for r, res in enumerate(ranks):
        for dropout in ("0.0", "0.3"):
            for a, e in zip(res[f"{dropout}-True"], res[f"{dropout}-False"]):
                assert_close(a, e, f"rank {r} dropout {dropout}: cached vs full-batch DDP step", 1e-11, 1e-9)
        for a, e in zip(res["0.0-True"], single):
            assert_close(a, e, f"rank {r}: cached DDP step vs one process", 1e-11, 1e-9)
        for a, e in zip(res["0.3-True"], ranks[0]["0.3-True"]):
            assert torch.equal(a, e), "DDP: every rank holds the same reduced gradient"


# ----------------------------------------------------------------------------- GradCache


def test_equal_to_luyug_gradcache() -> None:
    try:
        from grad_cache import GradCache
    except ImportError:
        pytest.skip("luyug's GradCache (import grad_cache) is not importable")
    enc = TinyEncoder(seed=9)

    class Keywords(nn.Module):  # GradCache calls a model on a dict as model(**chunk)
        def __init__(self) -> None:
            super().__init__()
            self.inner = enc

        def forward(self, **batch: torch.Tensor) -> torch.Tensor:
            return self.inner(batch)

    inputs = [_texts(14, 1), _texts(14, 2)]
    loss_fn = lambda q, d: flashcl.info_nce_loss(q, d, temperature=0.1)  # noqa: E731
    torch.manual_seed(5)
    wrapped = Keywords()
    GradCache([wrapped, wrapped], chunk_sizes=4, loss_fn=loss_fn, get_rep_fn=None)(*inputs)
    theirs = _grads(enc)
    enc.zero_grad()
    torch.manual_seed(5)
    flashcl.cached_step(enc, inputs, loss_fn, chunk_size=4)
    for a, e in zip(_grads(enc), theirs):
        assert_close(a, e, "flashcl.cached_step vs GradCache", 1e-12, 1e-10)


class TinyTokenEncoder(TinyEncoder):
    """The same transformer returning its (B, L, D) token embeddings (late interaction)."""

    def forward(self, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
        h = self.layer(self.embed(batch["input_ids"]), src_key_padding_mask=batch["attention_mask"] == 0)
        return self.proj(h)


@pytest.mark.parametrize("chunk", [1, 4])
@pytest.mark.parametrize("backend", ["dense", "tiled"])
def test_token_embeddings_and_masks_through_maxsim(chunk: int, backend: str) -> None:
    """An encoder of (B, L, D) token embeddings trains through cached_step with
    maxsim_loss, the masks passed as keyword arguments: the full batch's gradients."""
    queries, docs = _texts(6, 31), _texts(9, 32)  # 3 hard negatives

    def loss_fn(q: torch.Tensor, d: torch.Tensor, query_mask: torch.Tensor, doc_mask: torch.Tensor) -> torch.Tensor:
        return flashcl.maxsim_loss(
            q, d, query_mask=query_mask, doc_mask=doc_mask, temperature=0.1, backend=backend, block_size=2
        )

    masks = {"query_mask": queries["attention_mask"], "doc_mask": docs["attention_mask"]}
    _compare([TinyTokenEncoder()] * 2, [queries, docs], loss_fn, chunk, **masks)
    distill = _texts(6 * 3, 33)

    def distill_fn(q: torch.Tensor, d: torch.Tensor, teacher: torch.Tensor, doc_mask: torch.Tensor) -> torch.Tensor:
        return flashcl.maxsim_distill_loss(
            q, d.view(6, 3, *d.shape[1:]), teacher, doc_mask=doc_mask, backend=backend, block_size=2
        )

    teacher = torch.randn(6, 3, dtype=F64, generator=torch.Generator().manual_seed(34))
    dmask = distill["attention_mask"].view(6, 3, -1)
    _compare([TinyTokenEncoder()] * 2, [queries, distill], distill_fn, chunk, teacher=teacher, doc_mask=dmask)
