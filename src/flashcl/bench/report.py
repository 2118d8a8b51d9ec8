"""Tables (Markdown) and plots (PNG) of benchmark rows."""
from __future__ import annotations

import os
from typing import Any, Dict, List, Optional

Row = Dict[str, Any]

HEADER = ["group", "implementation", "size", "forward", "backward", "fwd+bwd", "vs bound (bound)",
          "peak mem (first / steady)", "beyond grad", "loss", "vs flashcl"]


def agreement(r: Row, rows: List[Row]) -> str:
    """The loss against flashcl's on the same group, size and formula: "equal"
    (within 1e-4 relative; for half-precision inputs, within that dtype's
    epsilon, since a peer may compute its loss in it), "other formula" (a stated
    formula difference), or "DIFFERS"."""
    if r.get("status") != "ok" or r["workload"] == "gemm3" or r["label"].startswith("flashcl"):
        return ""
    same = [o for o in rows if o is not r and o.get("status") == "ok" and o["label"].startswith("flashcl")
            and o["group"] == r["group"] and o["workload"] == r["workload"]
            and {k: v for k, v in o["params"].items() if k != "impl"} ==
            {k: v for k, v in r["params"].items() if k != "impl"}]
    if not same:
        return "other formula" if "formula" in r["label"] else ""
    ref = same[0]["loss"]
    err = abs(r["loss"] - ref) / max(1.0, abs(ref))
    if err <= 1e-4:
        return "equal"
    eps = {"bfloat16": 2.0 ** -7, "float16": 2.0 ** -10}.get(r["params"].get("dtype", ""))
    return f"equal (within {r['params']['dtype']} eps)" if eps is not None and err <= eps else "DIFFERS"


def size_label(r: Row) -> str:
    hidden = ("impl", "classes", "device", "simcse", "strategy", "repeats")
    return ", ".join(f"{k}={v}" for k, v in r["params"].items() if k not in hidden)


def size_value(r: Row) -> int:
    """The plot's x: the case's ``x`` parameter (e.g. the world size), else B or n."""
    p = r["params"]
    return int(p[r["x"]] if r.get("x") else p.get("B", p.get("n", 0)))


def _ms(s: float) -> str:
    return f"{s * 1e3:.1f} ms" if s < 10 else f"{s:.1f} s"


def fmt_row(r: Row) -> List[str]:
    head = [r["group"], r["label"], size_label(r)]
    status = r.get("status")
    if status != "ok":
        why = {"capped": f"capped at {r.get('cap_s', '?')} s", "oom": "out of memory (limit)",
               "not installed": "not installed", "skipped": "skipped (failed at a smaller size)"}.get(
            status or "", status or "?")
        detail = r.get("error", "")
        return head + [why, "", "", "", "", str(detail)[:80], "", ""]
    ratio = f"{r['ratio']:.2f}x ({_ms(r['bound_s'])})" if "ratio" in r else ""
    steady = f" / {r['steady_peak_mb']:.0f}" if r.get("steady_peak_mb") is not None else ""
    if r["workload"] == "neighbor":
        beyond = f"{r['peak_mb'] / (r['params']['n'] ** 2 * 4 / 2**20):.2f}x input"
    else:
        beyond = f"{r['peak_mb'] - r.get('grad_mb', 0.0):.0f} MB"
    loss = f"{r['loss']:.6g}" if r["workload"] != "gemm3" else ""
    return head + [_ms(r["fwd_s"]), _ms(r["bwd_s"]), _ms(r["time_s"]), ratio, f"{r['peak_mb']:.0f}{steady} MB",
                   beyond, loss, r.get("agreement", "")]


NOTES = ("forward / backward / fwd+bwd: the best of the repeats (a capped case ran once and was stopped); "
         "flashcl's tiled backend forms the gradient during the forward pass when the loss is reduced to a "
         "scalar, so its time shows as forward; for the GEMM bound, forward is S = E E^T. "
         "vs bound: best time over the best time of the bound, timed alternately in the same process: the "
         "three GEMMs no exact loss can avoid (S = E E^T, G E, G^T E; torch.mm into preallocated outputs), "
         "or, for the neighbour loss, its gather fix (one gather instead of Python loops). peak mem: peak "
         "memory of the first call above "
         "what was in use before it (on the CPU this includes one-time costs such as MKL's GEMM workspace, "
         "~15 MB), then of a later call (steady state). beyond grad: first-call peak minus the inputs' "
         "gradient; for the neighbour loss, first-call peak over the size of the score matrix. vs flashcl: "
         "the loss value against flashcl's on the same inputs and formula (equal within 1e-4 relative, or "
         "within the input dtype's epsilon for a peer that computes in bfloat16 / float16); "
         "'other formula' where the implementation computes a different, stated loss.")


def markdown(rows: List[Row], machine: Dict[str, Any], command: str) -> str:
    for r in rows:
        r["agreement"] = agreement(r, rows)
    lines = [f"Measured {machine['date']} on {machine['cpu']} ({machine['threads']} threads), device "
             f"{machine['device']}, torch {machine['torch']}, flashcl {machine['git']}: `{command}`"]
    for suite in dict.fromkeys(r["suite"] for r in rows):
        lines += ["", f"### {suite}", "", "| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
        lines += ["| " + " | ".join(fmt_row(r)) + " |" for r in rows if r["suite"] == suite]
    lines += ["", NOTES]
    return "\n".join(lines)


def plot(rows: List[Row], out_dir: str) -> List[str]:
    """time and memory vs size per suite (log-log), one line per implementation,
    the GEMM bound as a dashed line; returns the PNG paths (none without matplotlib)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    paths = []
    for suite in dict.fromkeys(r["suite"] for r in rows):
        if suite == "gpu":
            path = plot_panels([r for r in rows if r["suite"] == suite], out_dir, suite)
            if path is not None:
                paths.append(path)
            continue
        ok = [r for r in rows if r["suite"] == suite and r.get("status") == "ok"]
        # one line per implementation: of the neighbour loss, k = 2
        ok = [r for r in ok if r["params"].get("k", 2) == 2]
        if not ok:
            continue
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
        for ax, key, ylabel in ((axes[0], "time_s", "forward + backward (s)"),
                                (axes[1], "peak_mb", "peak memory above inputs (MB)")):
            lines = dict.fromkeys((r["group"], r["label"]) for r in ok)
            multi = len({g for g, _ in lines}) > 1 and any(r.get("x") for r in ok)
            for group, label in lines:
                pts = sorted((size_value(r), r[key]) for r in ok
                             if r["label"] == label and r["group"] == group and r[key] > 0)
                if not pts:
                    continue
                style = "--" if "bound" in label.lower() else "-"
                name = f"{label} ({group})" if multi else label
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", label=name)
            if key == "time_s":
                bound = sorted({(size_value(r), r["bound_s"]) for r in ok if "bound_s" in r
                                and r.get("bound", {}).get("workload") == "gemm3"})
                if bound:
                    ax.plot([b[0] for b in bound], [b[1] for b in bound], "k--", label="GEMM bound (3 GEMMs)")
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlabel("world size, or batch size B (or n)" if any(r.get("x") for r in ok)
                          else "batch size B (or n)")
            ax.set_ylabel(ylabel)
            ax.grid(True, which="both", alpha=0.3)
        axes[0].legend(fontsize=7)
        fig.suptitle(f"flashcl bench: {suite}")
        fig.tight_layout()
        path = os.path.join(out_dir, f"{suite}.png")
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths


def plot_panels(rows: List[Row], out_dir: str, suite: str) -> Optional[str]:
    """One panel per group (a loss at one embedding width): time against the batch
    size, one line per implementation and the GEMM bound dashed; every
    implementation has one colour and one legend entry across the panels."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    ok = [r for r in rows if r.get("status") == "ok"]
    groups = list(dict.fromkeys(r["group"] for r in rows))
    if not ok or not groups:
        return None
    labels = list(dict.fromkeys(r["label"] for r in rows))
    colours = {label: f"C{i % 10}" for i, label in enumerate(labels)}
    cols = min(4, len(groups))
    nrows = (len(groups) + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(4 * cols, 3.2 * nrows), squeeze=False)
    handles: Dict[str, Any] = {}
    for ax, group in zip(axes.flat, groups):
        mine = [r for r in ok if r["group"] == group]
        for label in labels:
            pts = sorted((size_value(r), r["time_s"]) for r in mine if r["label"] == label)
            if pts:
                (line,) = ax.plot([p[0] for p in pts], [p[1] for p in pts], "-o", color=colours[label])
                handles.setdefault(label, line)
        bound = sorted({(size_value(r), r["bound_s"]) for r in mine if "bound_s" in r})
        if bound:
            (line,) = ax.plot([b[0] for b in bound], [b[1] for b in bound], "k--", marker="x")
            handles.setdefault("three GEMMs (cuBLAS)", line)
        ax.set_title(group, fontsize=9)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("batch size B")
        ax.set_ylabel("forward + backward (s)")
        ax.grid(True, which="both", alpha=0.3)
    for ax in list(axes.flat)[len(groups):]:
        ax.axis("off")
    fig.legend(list(handles.values()), list(handles.keys()), loc="lower center", ncol=min(6, len(handles)),
               fontsize=8)
    fig.suptitle(f"flashcl bench: {suite}")
    fig.tight_layout(rect=(0, 0.06, 1, 0.96))
    path = os.path.join(out_dir, f"{suite}.png")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def first_ok(rows: List[Row], **match: Any) -> Optional[Row]:
    for r in rows:
        if r.get("status") == "ok" and all(r.get(k) == v or r["params"].get(k) == v for k, v in match.items()):
            return r
    return None
