"""The benchmark suites: lists of cases, sized by ``quick`` / default / ``full``.

A case is ``{"suite", "group", "label", "workload", "params", "repeats", "bound"}``; ``group``
collects the cases of one table and plot line set, ``label`` names the implementation,
``params["impl"]`` selects it inside the workload (self-distillation's suite: :mod:`.ssl`)."""

from __future__ import annotations

from typing import Any, Dict, List

from .flex import flex
from .ssl import ssl

Case = Dict[str, Any]


def _size(mode: str, quick: Any, default: Any, full: Any) -> Any:
    return {"quick": quick, "default": default, "full": full}[mode]


def tiled(mode: str, device: str) -> List[Case]:
    """The tiled backend's targets: SupCon and CLIP against the GEMM bound, SupCon
    and SigLIP at a batch of 65536, and the neighbour loss against its gather fix.
    Each case gets a cap of 300 s (a 65536 batch alone takes ~30 s on 2 cores)."""
    b, d = _size(mode, (512, 64), (8192, 768), (8192, 768))
    big_b, big_d = _size(mode, (4096, 32), (65536, 256), (65536, 256))
    n_big = _size(mode, 1500, 20000, 20000)
    n_small = _size(mode, 200, 2000, 2000)
    gemm = {"workload": "gemm3", "params": {"B": b, "D": d, "device": device}}
    cases: List[Case] = []
    for impl in ("flashcl-tiled", "flashcl-dense", "pml"):
        cases.append(
            {
                "group": "supcon",
                "label": impl,
                "workload": "supcon",
                "bound": gemm,
                "params": {"B": b, "D": d, "classes": 5, "impl": impl},
            }
        )
    for impl in ("simcse-vectorized", "flashcl-tiled"):
        cases.append(
            {
                "group": "supcon",
                "label": f"{impl} (SimCSE formula)",
                "workload": "supcon",
                "bound": gemm,
                "params": {"B": b, "D": d, "classes": 5, "impl": impl, "simcse": True},
            }
        )
    cases.append(
        {
            "group": "supcon-big",
            "label": "flashcl-tiled",
            "workload": "supcon",
            "repeats": 0,
            "params": {"B": big_b, "D": big_d, "classes": 5, "impl": "flashcl-tiled"},
        }
    )
    cases.append(
        {
            "group": "siglip-big",
            "label": "flashcl-tiled",
            "workload": "siglip",
            "repeats": 0,
            "params": {"B": big_b, "D": big_d, "impl": "flashcl-tiled"},
        }
    )
    for impl in ("flashcl-tiled", "flashcl-dense", "torch-ce"):
        cases.append(
            {
                "group": "clip",
                "label": impl,
                "workload": "clip",
                "bound": gemm,
                "params": {"B": b, "D": d, "impl": impl},
            }
        )
    for n, group in ((n_big, "neighbor-big"), (n_small, "neighbor-small")):
        gather = {"workload": "neighbor", "params": {"n": n, "k": 2, "impl": "gather-fix", "device": device}}
        impls = (
            ("log-form", "stable-logsumexp", "flashcl-tiled")
            if group == "neighbor-big"
            else ("python-loops", "flashcl-tiled")
        )
        for impl in impls:
            loops = impl == "python-loops"
            cases.append(
                {
                    "group": group,
                    "label": impl,
                    "workload": "neighbor",
                    "bound": gather,
                    "repeats": 1 if loops else (2 if group == "neighbor-big" else 5),
                    "params": {"n": n, "k": 2, "impl": impl},
                }
            )
    for case in cases:
        case["cap_s"] = 300.0
    return cases


def neighbors(mode: str, device: str) -> List[Case]:
    """The sampled-neighbours loss: n in {1000, 2000, 3000} x neighbours in {1, 2, 3},
    forward and backward time of the program with Python loops (capped), its gather fix,
    its log form and flashcl; n = 20000 for the vectorised ones."""
    ns = _size(mode, (100, 200), (1000, 2000, 3000), (1000, 2000, 3000))
    ks = _size(mode, (1, 2), (1, 2, 3), (1, 2, 3))
    big = _size(mode, 1000, 20000, 20000)
    cases: List[Case] = []
    for n in ns:
        for k in ks:
            for impl in ("python-loops", "gather-fix", "log-form", "flashcl-tiled", "flashcl-dense"):
                slow = impl == "python-loops"
                if slow and n > 2000 and mode == "default":
                    continue  # past its cap at n = 3000 for every k: measured only with --full
                cases.append(
                    {
                        "group": f"n={n}",
                        "label": impl,
                        "workload": "neighbor",
                        "repeats": 0 if slow else 2,
                        # n = 2000, k = 3 takes ~5 s on a quiet 2-core machine: room for a busy one
                        "cap_s": 12.0 if slow and mode != "full" else None,
                        "params": {"n": n, "k": k, "impl": impl},
                    }
                )
    # n = 20000 (30 s of the default run's budget) with --full, and in --suite tiled
    big_impls = (
        ("gather-fix", "log-form", "stable-logsumexp", "flashcl-tiled", "flashcl-dense")
        if mode == "full"
        else ("gather-fix", "log-form", "flashcl-tiled")
        if mode == "quick"
        else ()
    )
    for impl in big_impls:
        cases.append(
            {
                "group": f"n={big}",
                "label": impl,
                "workload": "neighbor",
                "repeats": 1 if mode == "full" else 0,
                "cap_s": 60.0,
                "params": {"n": big, "k": 2, "impl": impl},
            }
        )
    return cases


def simcse(mode: str, device: str) -> List[Case]:
    """Supervised SimCSE: per-sample loop vs vectorised vs flashcl (dense, tiled), with
    its formula (t = 0.05, self in the denominator, positives summed)."""
    bs = _size(mode, (32, 256), (32, 256, 1024, 4096), (32, 256, 1024, 4096, 8192, 16384))
    d = _size(mode, 32, 768, 768)
    cases: List[Case] = []
    for b in bs:
        gemm = {"workload": "gemm3", "params": {"B": b, "D": d, "device": device}}
        for impl in ("simcse-per-sample", "simcse-vectorized", "flashcl-dense", "flashcl-tiled"):
            slow = impl == "simcse-per-sample"
            reps = 0 if slow else 2
            cases.append(
                {
                    "group": "simcse",
                    "label": impl,
                    "workload": "supcon",
                    "bound": gemm,
                    "repeats": reps,
                    "cap_s": 6.0 if slow and mode != "full" else None,
                    "params": {"B": b, "D": d, "classes": 5, "impl": impl, "simcse": True},
                }
            )
    return cases


def peers(mode: str, device: str) -> List[Case]:
    """The same work through the libraries users would pick instead."""
    b, d = _size(mode, (256, 32), (2048, 768), (8192, 768))
    gemm = {"workload": "gemm3", "params": {"B": b, "D": d, "device": device}}
    cases: List[Case] = []
    # compiling takes ~40 s the first time: with --full only, with its own cap
    compiled = ("torch.compile(dense)",) if mode == "full" else ()
    for impl in ("flashcl-tiled", "flashcl-dense", "pml") + compiled:
        cases.append(
            {
                "group": "supcon",
                "label": impl,
                "workload": "supcon",
                "bound": gemm,
                "cap_s": 180.0 if "compile" in impl else None,
                "params": {"B": b, "D": d, "classes": 5, "impl": impl},
            }
        )
    nb = _size(mode, 64, 1024, 1024)
    for impl in ("flashcl-tiled", "flashcl-pml-adapter", "pml"):
        cases.append(
            {
                "group": "nt_xent",
                "label": impl,
                "workload": "nt_xent",
                "repeats": 1,
                "params": {"B": nb, "D": d, "impl": impl},
            }
        )
    for impl in ("flashcl-tiled", "torch-ce", "open_clip"):
        cases.append(
            {
                "group": "clip",
                "label": impl,
                "workload": "clip",
                "bound": gemm,
                "params": {"B": b, "D": d, "impl": impl},
            }
        )
    # SigLIP: open_clip's B x B logits beside flashcl; B = 4096 by default (at 8192 a call
    # takes ~2.2 s on 2 cores, and the warm-up, the repeat and the bound passed the cap on a
    # busy machine), 8192 with --full
    bs = _size(mode, 256, 4096, 8192)
    gemm_s = {"workload": "gemm3", "params": {"B": bs, "D": d, "device": device}}
    for impl in ("flashcl-tiled", "open_clip"):
        cases.append(
            {
                "group": "siglip",
                "label": impl,
                "workload": "siglip",
                "bound": gemm_s,
                "repeats": 1,
                "cap_s": 30.0 if mode != "full" else None,
                "params": {"B": bs, "D": d, "impl": impl},
            }
        )
    for impl in (
        "flashcl-tiled",
        "F.cross_entropy",
        "F.linear_cross_entropy(chunked)",
        "sentence-transformers-MNRL",
        "flashcl-st-adapter",
    ):
        cases.append(
            {
                "group": "info_nce",
                "label": impl,
                "workload": "info_nce",
                "bound": gemm,
                "params": {"B": b, "D": d, "impl": impl},
            }
        )
    return cases


def scale(mode: str, device: str) -> List[Case]:
    """Time and peak memory against batch size, SupCon with D = 256, up to the
    largest batch each implementation runs within the memory limit."""
    bs = _size(
        mode, (256, 512, 1024), (1024, 2048, 4096, 8192, 16384), (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
    )
    d = _size(mode, 32, 256, 256)
    cases: List[Case] = []
    for b in bs:
        reps = 1 if mode == "full" else 0
        cases.append(
            {
                "group": "scale",
                "label": "GEMM bound",
                "workload": "gemm3",
                "repeats": reps,
                "params": {"B": b, "D": d},
                "stop_after_fail": True,
                "cap_s": 30.0,
            }
        )
        # the dense losses at B = 16384 (45 s of the default run's budget) with --full only
        impls = (
            ("flashcl-tiled",)
            if b > 8192 and mode == "default"
            else ("flashcl-tiled", "flashcl-dense", "simcse-vectorized", "pml")
        )
        for impl in impls:
            # the vectorised supervised SimCSE loss with its own formula (the others: SupCon L_out)
            label = "simcse-vectorized (SimCSE formula)" if impl == "simcse-vectorized" else impl
            cases.append(
                {
                    "group": "scale",
                    "label": label,
                    "workload": "supcon",
                    "repeats": reps,
                    "params": {"B": b, "D": d, "classes": 5, "impl": impl, "simcse": impl == "simcse-vectorized"},
                    "stop_after_fail": True,
                    "cap_s": 30.0 if mode != "full" else None,
                }
            )
    if mode == "full":  # a million classes: the margin softmax's memory beyond the weights and their gradient
        cases.append(
            {
                "group": "scale: CosFace, C = 1M",
                "label": "flashcl-tiled",
                "workload": "ranking",
                "repeats": 0,
                "cap_s": 900.0,
                "params": {
                    "B": 1024,
                    "D": 512,
                    "C": 1_000_000,
                    "loss": "cosface",
                    "impl": "flashcl-tiled",
                    "device": device,
                },
            }
        )
    return cases + (requested(mode, device) if mode == "full" else [])


def requested(mode: str, device: str) -> List[Case]:
    """The losses users ask the peers for (multi-label SupCon, distillation,
    uniformity, retrieval metrics), D = 64: the tiled path at B = 4096 and 65536
    against the dense formula at 4096, time and peak memory. Part of the scale
    suite with ``--full``; alone: ``flashcl bench --suite requested``."""
    small, big = _size(mode, (256, 1024), (4096, 65536), (4096, 65536))
    cases: List[Case] = []
    for loss in ("multilabel", "distill", "uniformity", "retrieval"):
        for b in (small, big):
            impls = ("flashcl-tiled",) if b == big or loss == "retrieval" else ("flashcl-tiled", "dense formula")
            for impl in impls:
                cases.append(
                    {
                        "group": f"requested: {loss}",
                        "label": impl,
                        "workload": "requested",
                        "repeats": 0,
                        "params": {"B": b, "D": 64, "impl": impl, "loss": loss, "device": device},
                        "cap_s": 900.0,
                    }
                )
    return cases


def ranking(mode: str, device: str) -> List[Case]:
    """CoSENT against sentence-transformers' CoSENTLoss (B = 4096 .. 65536, D = 256),
    batch-all and batch-hard triplets against sentence-transformers and
    pytorch-metric-learning (B = 2048 .. 16384, D = 128, 64 classes), CosFace over
    C = 100k and 1M classes against PML's CosFaceLoss (B = 1024, D = 512): time and
    peak memory, out of memory past the limit."""
    cosent_bs = _size(mode, (256, 1024), (4096, 16384, 65536), (4096, 16384, 65536))
    triplet_bs = _size(mode, (128, 256), (2048, 4096, 8192, 16384), (2048, 4096, 8192, 16384))
    classes = _size(mode, (1000, 5000), (100_000, 1_000_000), (100_000, 1_000_000))
    cases: List[Case] = []

    def add(group: str, label: str, params: Dict[str, Any]) -> None:
        case: Case = {
            "group": group,
            "label": label,
            "workload": "ranking",
            "repeats": 1,
            "cap_s": 600.0,
            "params": dict(params, impl=label, device=device),
        }
        if "C" in params:
            case["x"] = "C"  # CosFace's panel: against the number of classes
        cases.append(case)

    for b in cosent_bs:
        for impl in ("flashcl-tiled", "sentence-transformers"):
            add("ranking: CoSENT", impl, {"B": b, "D": _size(mode, 32, 256, 256), "loss": "cosent"})
    for mining in ("all", "hard"):
        for b in triplet_bs:
            for impl in ("flashcl-tiled", "sentence-transformers"):
                add(
                    f"ranking: batch-{mining} triplets",
                    impl,
                    {"B": b, "D": _size(mode, 32, 128, 128), "loss": "triplet", "mining": mining, "formula": "st"},
                )
    for b in triplet_bs:
        for impl in ("flashcl-tiled", "pml"):
            add(
                "ranking: triplets, PML's TripletMarginLoss",
                impl,
                {"B": b, "D": _size(mode, 32, 128, 128), "loss": "triplet", "mining": "all", "formula": "pml"},
            )
    for c in classes:
        for impl in ("flashcl-tiled", "pml"):
            add(
                "ranking: CosFace",
                impl,
                {"B": _size(mode, 64, 1024, 1024), "D": _size(mode, 32, 512, 512), "C": c, "loss": "cosface"},
            )
    return cases


def compile_suite(mode: str, device: str) -> List[Case]:
    """A training step (small MLP encoder, SupCon or CLIP, backward, SGD step) eager
    against ``torch.compile(fullgraph=True)`` of the encoder and the loss, B = 4096,
    D = 256: time per step (the best of 3 after the first, which compiles) and peak
    memory."""
    b, d = _size(mode, (256, 32), (4096, 256), (4096, 256))
    return [
        {
            "group": f"compile: {loss}",
            "label": impl,
            "workload": "compiled_step",
            "repeats": 3,
            "cap_s": 900.0,
            "params": {"B": b, "D": d, "loss": loss, "impl": impl, "device": device},
        }
        for loss in ("supcon", "clip")
        for impl in ("eager", "compiled")
    ]


def dist(mode: str, device: str) -> List[Case]:
    """flashcl.distributed SupCon across processes (gloo, one machine): per-rank
    time and peak memory against the world size at a fixed global batch, and
    against the global batch at two processes, for all_gather and ring."""
    b = _size(mode, 256, 4096, 16384)
    d = _size(mode, 16, 256, 256)
    worlds = _size(mode, (1, 2), (1, 2, 4), (1, 2, 4, 8))
    batches = _size(mode, (128, 256), (2048, 4096, 8192), (4096, 8192, 16384, 32768))
    cases: List[Case] = []
    for strategy in ("all_gather", "ring"):
        for w in worlds:
            cases.append(
                {
                    "group": "world",
                    "label": strategy,
                    "workload": "dist",
                    "x": "world",
                    "params": {"B": b, "D": d, "world": w, "strategy": strategy, "repeats": 1},
                }
            )
        for bb in batches:
            cases.append(
                {
                    "group": "global batch (2 ranks)",
                    "label": strategy,
                    "workload": "dist",
                    "params": {"B": bb, "D": d, "world": 2, "strategy": strategy, "repeats": 1},
                }
            )
    return cases


def gpu(mode: str, device: str) -> List[Case]:
    """GPU figures (``--device cuda``): InfoNCE, SupCon, CLIP and SigLIP through
    flashcl's Triton kernels and its tiled backend (tensor-core stripes for half
    precision, their element-wise work by the fused stripe kernels and eagerly),
    beside Inf-CL (InfoNCE) and open_clip (CLIP, SigLIP), bfloat16, against the three
    cuBLAS GEMMs of the same shape; and InfoNCE in float32 (IEEE) at D = 768 against
    float32 GEMMs. Each (loss, D) is one panel of the plot."""
    # in the order of priority (a device run may be cut short): the widths users
    # train with first, then the other widths, then the largest batches
    sizes = _size(
        mode,
        ((1024, 256),),
        ((32768, 768), (32768, 4096), (32768, 256), (32768, 1024), (131072, 768), (131072, 4096)),
        tuple((b, d) for b in (32768, 131072) for d in (768, 4096, 256, 1024)) + ((262144, 768),),
    )
    # flashcl-tiled: the stripes with the fused stripe kernels (the default on CUDA);
    # flashcl-stripes-eager: the same stripes, their element-wise work in eager passes
    impls = {
        "info_nce": ("flashcl-tiled", "flashcl-stripes-eager", "flashcl-triton", "inf_cl"),
        "supcon": ("flashcl-tiled", "flashcl-stripes-eager", "flashcl-triton"),
        "clip": ("flashcl-tiled", "flashcl-stripes-eager", "flashcl-triton", "open_clip"),
        "siglip": ("flashcl-tiled", "flashcl-stripes-eager", "flashcl-triton", "open_clip"),
    }
    cases: List[Case] = []
    for b, d in sizes:
        gemm = {"workload": "gemm3", "params": {"B": b, "D": d, "device": device, "dtype": "bfloat16"}}
        for loss, names in impls.items():
            for impl in names:
                params: Dict[str, Any] = {"B": b, "D": d, "impl": impl, "dtype": "bfloat16"}
                if loss == "supcon":
                    params["classes"] = 1000
                cases.append(
                    {
                        "group": f"{loss} D={d}",
                        "label": impl,
                        "workload": loss,
                        "bound": gemm,
                        "stop_after_fail": True,
                        "params": params,
                    }
                )
    b32 = _size(mode, 1024, 32768, 32768)
    gemm32 = {"workload": "gemm3", "params": {"B": b32, "D": 768, "device": device, "dtype": "float32"}}
    for impl in ("flashcl-triton", "flashcl-tiled"):
        cases.append(
            {
                "group": "info_nce D=768 float32",
                "label": impl,
                "workload": "info_nce",
                "bound": gemm32,
                "params": {"B": b32, "D": 768, "impl": impl, "dtype": "float32"},
            }
        )
    return cases


def gpu_losses(mode: str, device: str) -> List[Case]:
    """The other losses on a GPU (``--device cuda``), bfloat16, in the order of priority
    (a device run may be cut short): InfoNCE at B = 1,048,576, D = 768 (the peak beyond
    the embeddings and their gradients); flex losses (SupCon with class labels, InfoNCE
    with same-label keys left out) against the built-in and the dense masked formula;
    SupCon against a 65,536-entry queue; Matryoshka InfoNCE at 5 widths and GISTEmbed at
    D = 768 beside sentence-transformers; the late-interaction loss beside
    late-interaction-kernels and flash-maxsim; DINO and iBOT over 65,536 prototypes at the
    CPU suite's largest batch and 8x it; CosFace over 1M classes beside
    pytorch-metric-learning."""
    bf16 = "bfloat16"
    cases: List[Case] = []

    def add(group: str, label: str, workload: str, params: Dict[str, Any], **extra: Any) -> None:
        cases.append(
            {
                "group": group,
                "label": label,
                "workload": workload,
                "repeats": 1,
                "cap_s": 120.0,
                "stop_after_fail": True,
                "params": params,
                **extra,
            }
        )

    big = _size(mode, 4096, 1_048_576, 1_048_576)
    for impl in ("flashcl-tiled", "flashcl-triton"):
        add(
            f"InfoNCE, B = {big:,}, D = 768",
            impl,
            "info_nce",
            {"B": big, "D": 768, "impl": impl, "dtype": bf16},
            repeats=0,
        )
    fb = _size(mode, 1024, 65536, 65536)
    for loss, name in (("supcon", "SupCon, labels"), ("info_nce", "InfoNCE, same-label keys out")):
        for impl in ("flex", "builtin", "dense"):
            add(f"flex: {name}, D = 768", impl, "flex", {"B": fb, "D": 768, "loss": loss, "impl": impl, "dtype": bf16})
    qb, qd, qq = _size(mode, (256, 64, 4096), (4096, 768, 65536), (4096, 768, 65536))
    for impl in ("flashcl-tiled", "pml"):
        add(
            f"SupCon + queue of {qq:,}, B = {qb}, D = {qd}",
            impl,
            "queue",
            {"B": qb, "D": qd, "Q": qq, "impl": impl, "dtype": bf16},
        )
    mb = _size(mode, 1024, 32768, 32768)
    for impl in ("flashcl-one-pass", "flashcl-separate", "sentence-transformers"):
        add(
            f"Matryoshka InfoNCE, 5 widths, B = {mb}, D = 768",
            impl,
            "matryoshka",
            {"B": mb, "D": 768, "dims": (768, 512, 256, 128, 64), "impl": impl, "dtype": bf16},
        )
    for gb in _size(mode, (256,), (4096, 32768), (4096, 32768)):
        for impl in ("flashcl-tiled", "sentence-transformers"):
            add(
                "GISTEmbed, D = 768, guide 384",
                impl,
                "gist",
                {"B": gb, "D": 768, "G": 384, "impl": impl, "dtype": bf16},
                x="B",
            )
    lq, d = 32, 128
    for ld in (128, 512):
        for b in _size(mode, (64,), (512, 4096), (512, 4096)):
            for impl in ("flashcl-tiled", "late-interaction-kernels", "flash-maxsim"):
                add(
                    f"late interaction, Lq = {lq}, Ld = {ld}, D = {d}",
                    impl,
                    "late_interaction",
                    {"B": b, "Lq": lq, "Ld": ld, "D": d, "impl": impl, "dtype": bf16},
                    x="B",
                )
    k, pd = _size(mode, (4096, 64), (65536, 256), (65536, 256))
    for name, sv, tv, sizes in (
        ("iBOT", 1, 1, _size(mode, (256,), (16384, 131072), (16384, 131072))),
        ("DINO 2 + 10 views", 10, 2, _size(mode, (16,), (1024, 8192), (1024, 8192))),
    ):
        for b in sizes:
            for impl in ("flashcl-tiled", "dinov2"):
                add(
                    f"{name}, K = {k}, D = {pd}",
                    impl,
                    "self_distill",
                    {"B": b, "S": sv, "T": tv, "K": k, "D": pd, "targets": "softmax", "impl": impl, "dtype": bf16},
                    x="B",
                )
    for impl in ("flashcl-tiled", "pml"):
        add(
            "CosFace, B = 1024, D = 512",
            impl,
            "ranking",
            {"B": 1024, "D": 512, "C": _size(mode, 5000, 1_000_000, 1_000_000), "loss": "cosface", "impl": impl},
            x="C",
        )
    return cases


def beyond(mode: str, device: str) -> List[Case]:
    """Beyond the batch: SupCon against a full 65536-entry queue (B = 1024, D = 256)
    beside pytorch-metric-learning's CrossBatchMemory, and GISTEmbed (B = 256 to
    4096, D = 768, a 384-wide guide) beside sentence-transformers'."""
    b, d, q = _size(mode, (128, 32, 4096), (1024, 256, 65536), (1024, 256, 65536))
    cases: List[Case] = []
    for impl in ("flashcl-tiled", "flashcl-pml-adapter", "pml"):
        cases.append(
            {
                "group": "queue",
                "label": impl,
                "workload": "queue",
                "repeats": 1,
                "cap_s": 300.0,
                "params": {"B": b, "D": d, "Q": q, "impl": impl},
            }
        )
    gist_d = _size(mode, 64, 768, 768)
    # sentence-transformers' B x B x D broadcasts outgrow the memory limit near B = 1024:
    # the smaller batches give its figures
    for gb in _size(mode, (128, 256), (256, 512, 1024, 4096), (256, 512, 1024, 4096, 16384)):
        for impl in ("flashcl-tiled", "flashcl-dense", "sentence-transformers"):
            cases.append(
                {
                    "group": "gist",
                    "label": impl,
                    "workload": "gist",
                    "repeats": 1,
                    "cap_s": 300.0,
                    "stop_after_fail": True,
                    "params": {"B": gb, "D": gist_d, "G": 384, "impl": impl},
                }
            )
    return cases


def train(mode: str, device: str) -> List[Case]:
    """Large-batch training: peak memory and time of a full training step of
    all-MiniLM-L6-v2 against the batch (pairs), cached (flashcl.cached_step, chunks
    of 256 texts), uncached, and sentence-transformers' cached MNRL; and
    Matryoshka InfoNCE at 5 widths (D = 768) in one pass, as 5 calls, and as
    sentence-transformers computes it."""
    bs = _size(mode, (64, 128), (1024, 4096, 16384), (1024, 4096, 16384))
    chunk = _size(mode, 32, 256, 256)
    cases: List[Case] = []
    for b in bs:
        for impl in ("flashcl-cached", "flashcl-uncached", "sentence-transformers-cached"):
            cases.append(
                {
                    "group": "train step",
                    "label": impl,
                    "workload": "train_step",
                    "repeats": 0,
                    "cap_s": 900.0,
                    "stop_after_fail": True,
                    "params": {"B": b, "impl": impl, "chunk": chunk},
                }
            )
    mb, md = _size(mode, (256, 64), (4096, 768), (8192, 768))
    dims = _size(mode, (64, 32, 16, 8, 4), (768, 512, 256, 128, 64), (768, 512, 256, 128, 64))
    for impl in ("flashcl-one-pass", "flashcl-separate", "sentence-transformers"):
        cases.append(
            {
                "group": "matryoshka",
                "label": impl,
                "workload": "matryoshka",
                "repeats": 1,
                "cap_s": 300.0,
                "params": {"B": mb, "D": md, "dims": dims, "impl": impl},
            }
        )
    return cases


def contention(mode: str, device: str) -> List[Case]:
    """The tiled backend when another process keeps a core busy (data-loader
    workers do): SupCon, B = 4096, D = 256, tiled and dense against the three GEMMs,
    on a quiet machine and beside one busy process (the row's ``others_running``
    says how many ran)."""
    b, d = _size(mode, (1024, 64), (4096, 256), (8192, 256))
    gemm = {"workload": "gemm3", "params": {"B": b, "D": d, "device": device}}
    cases: List[Case] = []
    for busy, group in ((0, "quiet"), (1, "one busy process")):
        for impl in ("flashcl-tiled", "flashcl-dense"):
            cases.append(
                {
                    "group": group,
                    "label": impl,
                    "workload": "supcon",
                    "bound": gemm,
                    "repeats": 8,
                    "cap_s": 60.0,
                    "busy": busy,
                    "params": {"B": b, "D": d, "classes": 10, "impl": impl},
                }
            )
    return cases


def late_interaction(mode: str, device: str) -> List[Case]:
    """Late interaction (ColBERT, ColPali): the contrastive loss on token embeddings
    (Lq = 32, Ld = 128, D = 128 at full size) by flashcl and by pylate's and
    colpali-engine's own losses, B up to where the peers run out of memory and
    beyond; and flashcl's tiled loss at B = N = 512 against one GEMM of every query
    token against every document token, timed alternately in one process."""
    lq, ld, d = _size(mode, (8, 16, 16), (32, 128, 128), (32, 128, 128))
    sizes = _size(mode, (16, 32), (64, 256, 512, 1024), (64, 256, 512, 1024, 2048, 4096))
    gemm_b = _size(mode, 32, 512, 512)
    shape = {"Lq": lq, "Ld": ld, "D": d}
    cases: List[Case] = [
        {
            "group": f"MaxSim loss / one token GEMM, B = N = {gemm_b}",
            "label": "flashcl-tiled",
            "workload": "late_interaction",
            "bound": {"workload": "token_gemm", "params": {"B": gemm_b, **shape, "device": device}},
            "repeats": 2,
            "cap_s": 600.0,
            "params": {"B": gemm_b, **shape, "impl": "flashcl-tiled"},
        }
    ]
    impls = ["flashcl-tiled", "flashcl-dense", "pylate", "flashcl-pylate", "colpali-engine", "flashcl-colpali"]
    if device.startswith("cuda"):
        impls += ["late-interaction-kernels", "flash-maxsim"]
    # the peers score a padding token 0 (in the max): their values are compared with the drop-ins'
    versus = {"pylate": "flashcl-pylate", "colpali-engine": "flashcl-colpali"}
    versus.update({"late-interaction-kernels": "flashcl-pylate", "flash-maxsim": "flashcl-pylate"})
    for b in sizes:
        for impl in impls:
            case: Case = {
                "group": f"ColBERT contrastive loss, Lq = {lq}, Ld = {ld}, D = {d}",
                "label": impl,
                "workload": "late_interaction",
                "repeats": 1,
                "cap_s": 600.0,
                "stop_after_fail": True,
                "params": {"B": b, **shape, "impl": impl},
            }
            if impl in versus:
                case["versus"] = versus[impl]
            cases.append(case)
    return cases


def margin(mode: str, device: str) -> List[Case]:
    """Margin softmax over many classes: CosFace on one process against
    pytorch-metric-learning (B = 1024, D = 128), and ArcFace across gloo processes with
    the class weights sharded (``shard_classes=True``) against replicated on every
    rank, B = 1024 per rank, D = 128 (scaled down from 512 to fit a CPU machine's
    memory): per-rank time and peak memory beyond the rank's weights and gradient.
    ``--full``: C = 10M on 4 processes."""
    d = _size(mode, 16, 128, 128)
    b = _size(mode, 64, 1024, 1024)
    cases: List[Case] = []
    for c in _size(mode, (1000,), (100_000, 1_000_000), (100_000, 1_000_000)):
        for impl in ("flashcl-tiled", "pml"):
            cases.append(
                {
                    "group": f"CosFace, one process, B = {b}, D = {d}",
                    "label": impl,
                    "workload": "ranking",
                    "x": "C",
                    "repeats": 1,
                    "cap_s": 600.0,
                    "stop_after_fail": True,
                    "params": {"B": b, "D": d, "C": c, "loss": "cosface", "impl": impl},
                }
            )
    runs = _size(
        mode,
        ((2, 2000),),
        ((2, 1_000_000), (4, 1_000_000)),
        ((2, 1_000_000), (4, 1_000_000), (4, 10_000_000)),
    )
    for world, c in runs:
        for impl in ("sharded", "replicated"):
            if impl == "replicated" and c > 1_000_000:
                continue  # every rank holding 10M x D weights and their gradient: 10 GB per rank
            cases.append(
                {
                    "group": f"ArcFace, C = {c:,}, B = {b} per rank, D = {d}",
                    "label": impl,
                    "workload": "dist",
                    "x": "world",
                    "cap_s": 3600.0,
                    "params": {"B": b, "D": d, "C": c, "world": world, "loss": "margin", "impl": impl, "repeats": 0},
                }
            )
    return cases


def metric(mode: str, device: str) -> List[Case]:
    """Pair-weighted metric learning against pytorch-metric-learning's classes (with its
    miner): Multi-Similarity, Circle and Proxy-Anchor, D = 512, B from 1,024 to past
    where PML fits; Multi-Similarity against the three GEMMs at B = 8,192."""
    d = _size(mode, 32, 512, 512)
    sizes = _size(mode, (256,), (1024, 4096, 8192, 16384, 32768), (1024, 4096, 8192, 16384, 32768, 65536))
    bound_b = _size(mode, 256, 8192, 8192)
    cases: List[Case] = [
        {
            "group": f"Multi-Similarity with its miner / the three GEMMs, B = {bound_b}, D = {d}",
            "label": "flashcl-tiled",
            "workload": "ranking",
            "bound": {"workload": "gemm3", "params": {"B": bound_b, "D": d, "device": device}},
            "repeats": 3,
            "params": {"B": bound_b, "D": d, "loss": "multi_similarity", "impl": "flashcl-tiled"},
        }
    ]
    names = {"multi_similarity": "Multi-Similarity with its miner", "circle": "Circle", "proxy_anchor": "Proxy-Anchor"}
    for loss, name in names.items():
        for impl in ("flashcl-tiled", "pml"):
            for b in sizes:
                cases.append(
                    {
                        "group": f"{name}, D = {d}",
                        "label": impl,
                        "workload": "ranking",
                        "repeats": 5 if b <= 8192 else 1,  # a few ms at the smallest: the best of several
                        "cap_s": 900.0,
                        "stop_after_fail": True,
                        "params": {"B": b, "D": d, "loss": loss, "impl": impl, "device": device},
                    }
                )
    return cases


SUITES = {
    "tiled": tiled,
    "contention": contention,
    "neighbors": neighbors,
    "simcse": simcse,
    "peers": peers,
    "scale": scale,
    "dist": dist,
    "requested": requested,
    "compile": compile_suite,
    "ranking": ranking,
    "gpu": gpu,
    "gpu-losses": gpu_losses,
    "beyond": beyond,
    "train": train,
    "late-interaction": late_interaction,
    "margin": margin,
    "ssl": ssl,
    "flex": flex,
    "metric": metric,
}
DEFAULT_SUITES = ("neighbors", "simcse", "peers", "scale")
