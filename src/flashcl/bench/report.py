"""Tables (Markdown) and plots (PNG) of benchmark rows."""

from __future__ import annotations

import os
import textwrap
from typing import Any, Dict, Iterable, List

Row = Dict[str, Any]

HEADER = [
    "group",
    "implementation",
    "size",
    "forward",
    "backward",
    "fwd+bwd",
    "vs bound (bound)",
    "peak mem (first / steady)",
    "beyond grad",
    "loss",
    "vs flashcl",
]


def agreement(r: Row, rows: List[Row]) -> str:
    """The loss against flashcl's on the same group, size and formula: "equal"
    (within 1e-4 relative; for half-precision inputs, within that dtype's
    epsilon, since a peer may compute its loss in it), "other formula" (a stated
    formula difference), or "DIFFERS". A row's ``versus`` names the flashcl row of its
    formula (a drop-in that keeps the peer's convention)."""
    if r.get("status") != "ok" or r["workload"] == "gemm3" or r["label"].startswith("flashcl"):
        return ""
    same = [
        o
        for o in rows
        if o is not r
        and o.get("status") == "ok"
        and o["label"].startswith("flashcl")
        and o["label"] == r.get("versus", o["label"])
        and o["group"] == r["group"]
        and o["workload"] == r["workload"]
        and {k: v for k, v in o["params"].items() if k != "impl"}
        == {k: v for k, v in r["params"].items() if k != "impl"}
    ]
    if not same:
        return "other formula" if "formula" in r["label"] else ""
    ref = same[0]["loss"]
    err = abs(r["loss"] - ref) / max(1.0, abs(ref))
    if err <= 1e-4:
        return "equal"
    eps = {"bfloat16": 2.0**-7, "float16": 2.0**-10}.get(r["params"].get("dtype", ""))
    return f"equal (within {r['params']['dtype']} eps)" if eps is not None and err <= eps else "DIFFERS"


def size_label(r: Row) -> str:
    hidden = ("impl", "classes", "device", "simcse", "strategy", "repeats")
    return ", ".join(f"{k}={v}" for k, v in r["params"].items() if k not in hidden)


#: the plot's x axis for a case's ``x`` parameter
AXIS_LABELS = {"world": "world size", "C": "classes C"}


def size_value(r: Row) -> int:
    """The plot's x: the case's ``x`` parameter (e.g. the world size), else B or n."""
    p = r["params"]
    return int(p[r["x"]] if r.get("x") else p.get("B", p.get("n", 0)))


def _ms(s: float) -> str:
    return f"{s * 1e3:.1f} ms" if s < 10 else f"{s:.1f} s"


def failure(r: Row) -> str:
    """Why a row has no figures, in words ("capped at 10.0 s", "out of memory (limit)", ...)."""
    status = r.get("status")
    return {
        "capped": f"capped at {r.get('cap_s', '?')} s",
        "oom": "out of memory (limit)",
        "not installed": "not installed",
        "skipped": "skipped (failed at a smaller size)",
    }.get(status or "", status or "?")


def fmt_row(r: Row) -> List[str]:
    head = [r["group"], r["label"], size_label(r)]
    if r.get("status") != "ok":
        detail = r.get("error", "")
        return head + [failure(r), "", "", "", "", str(detail)[:80], "", ""]
    ratio = f"{r['ratio']:.2f}x ({_ms(r['bound_s'])})" if "ratio" in r else ""
    steady = f" / {r['steady_peak_mb']:.0f}" if r.get("steady_peak_mb") is not None else ""
    if r["workload"] == "neighbor":
        beyond = f"{r['peak_mb'] / (r['params']['n'] ** 2 * 4 / 2**20):.2f}x input"
    else:
        beyond = f"{r['peak_mb'] - r.get('grad_mb', 0.0):.0f} MB"
    loss = f"{r['loss']:.6g}" if r["workload"] != "gemm3" else ""
    return head + [
        _ms(r["fwd_s"]),
        _ms(r["bwd_s"]),
        _ms(r["time_s"]),
        ratio,
        f"{r['peak_mb']:.0f}{steady} MB",
        beyond,
        loss,
        r.get("agreement", ""),
    ]


NOTES = (
    "forward / backward / fwd+bwd: the best of the repeats (a capped case ran once and was stopped; its cap counts its "
    "timed calls, not its process's start, imports and inputs); "
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
    "'other formula' where the implementation computes a different, stated loss."
)


def markdown(rows: List[Row], machine: Dict[str, Any], command: str) -> str:
    for r in rows:
        r["agreement"] = agreement(r, rows)
    lines = [
        f"Measured {machine['date']} on {machine['cpu']} ({machine['threads']} threads), device "
        f"{machine['device']}, torch {machine['torch']}, flashcl {machine['git']}: `{command}`"
    ]
    if machine.get("others_running_mean") is not None:
        load = machine.get("load_avg_start") or []
        lines.append(
            f"Load: other processes running between cases {machine['others_running_mean']:.2f} on average; "
            f"load average at the start {' / '.join(f'{x:.2f}' for x in load)}."
            + (
                " **Contended run**: other work competed for the cores, timings are slower than on a quiet machine."
                if machine.get("contended")
                else ""
            )
        )
    for suite in dict.fromkeys(r["suite"] for r in rows):
        lines += ["", f"### {suite}", "", "| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
        lines += ["| " + " | ".join(fmt_row(r)) + " |" for r in rows if r["suite"] == suite]
        empty = no_result(r for r in rows if r["suite"] == suite)
        if empty:
            lines += [""] + [f"- **{panel}**: {why}" for panel, why in empty.items()]
    lines += ["", NOTES]
    return "\n".join(lines)


def panel_key(r: Row) -> str:
    """The panel a row is drawn in: the neighbour loss by ``k`` (its groups are the
    sizes), every other suite by group (a loss, a loss at one width)."""
    if r["workload"] == "neighbor":
        return f"k = {r['params'].get('k', '?')} neighbours"
    return str(r["group"])


def no_result(rows: Iterable[Row]) -> Dict[str, str]:
    """The panels without one successful row, each with why: ``{panel: "no result:
    flashcl-tiled capped at 10.0 s; open_clip not installed"}``."""
    panels: Dict[str, List[Row]] = {}
    for r in rows:
        panels.setdefault(panel_key(r), []).append(r)
    return {
        panel: "no result: "
        + "; ".join(dict.fromkeys(f"{r['label']} {failure(r)}" for r in inside if "bound" not in r["label"].lower()))
        for panel, inside in panels.items()
        if not any(r.get("status") == "ok" for r in inside)
    }


def _is_flashcl(label: str) -> bool:
    return label.startswith("flashcl")


def _words(ratio: float) -> str:
    if ratio >= 10:
        return f"{ratio:.0f}x faster"
    return f"{ratio:.1f}x faster" if ratio >= 1 else f"{1 / ratio:.1f}x slower"


def panel_finding(rows: List[Row]) -> str:
    """One panel's result in words: flashcl's fastest against the others, each at
    the largest size both ran, the largest and the smallest gap (and who ran out
    of memory or time)."""
    ok = [r for r in rows if r.get("status") == "ok" and "bound" not in r["label"].lower()]
    ours = [r for r in ok if _is_flashcl(r["label"])]
    if not ours:
        return ""
    gaps = []
    for label in dict.fromkeys(r["label"] for r in ok if not _is_flashcl(r["label"])):
        shared = sorted({size_value(r) for r in ok if r["label"] == label} & {size_value(r) for r in ours})
        if shared:
            size = shared[-1]
            mine = min((r for r in ours if size_value(r) == size), key=lambda r: r["time_s"])
            theirs = next(r for r in ok if r["label"] == label and size_value(r) == size)
            gaps.append((theirs["time_s"] / mine["time_s"], label, size, mine["label"]))
    parts = []
    if gaps:
        gaps.sort()
        hi = gaps[-1]
        parts.append(f"{hi[3]} {_words(hi[0])} than {hi[1]} ({hi[2]})")
        if len(gaps) > 1:
            lo = gaps[0]
            parts.append(f"{_words(lo[0])} than {lo[1]} ({lo[2]})")
    for status, words in (("oom", "out of memory"), ("capped", "over the time cap")):
        failed = sorted({r["label"] for r in rows if r.get("status") == status and not _is_flashcl(r["label"])})
        if failed:
            parts.append(", ".join(failed) + f": {words}")
    return "; ".join(parts)


def plot(rows: List[Row], out_dir: str) -> List[str]:
    """One PNG per suite: one panel per loss (the neighbour loss: per ``k``), time
    above and peak memory below, one colour per implementation across the panels
    and each name once in the legend, the sizes of an implementation joined by a
    line (a single size: bars), the GEMM bound dashed; each panel's title states its
    result. Returns the PNG paths (none without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    paths = []
    for suite in dict.fromkeys(r["suite"] for r in rows):
        mine = [r for r in rows if r["suite"] == suite]
        ok = [r for r in mine if r.get("status") == "ok"]
        if not ok:
            continue
        panels = list(dict.fromkeys(panel_key(r) for r in mine))
        labels = list(dict.fromkeys(r["label"] for r in mine))
        colours = {label: f"C{i % 10}" for i, label in enumerate(labels)}
        memory = any(r.get("peak_mb") for r in ok) and suite != "gpu"
        side = len(panels) == 1 and memory  # one panel: time and memory side by side
        cols = 3 if len(panels) in (5, 6) else min(4, len(panels))
        blocks = (len(panels) + cols - 1) // cols
        rows_per_block = 2 if memory and not side else 1
        fig, axes = plt.subplots(
            blocks * rows_per_block,
            2 if side else cols,
            figsize=(10 if side else 4.2 * cols, 3.6 * blocks * rows_per_block),
            squeeze=False,
        )
        handles: Dict[str, Any] = {}
        for p, panel in enumerate(panels):
            inside = [r for r in mine if panel_key(r) == panel]
            good = [r for r in inside if r.get("status") == "ok"]
            block, col = divmod(p, cols)
            if not good:  # a panel with no result says why, in place of its figures
                why = no_result(inside).get(panel, "no result")
                for m in range(rows_per_block if not side else 2):
                    ax = axes[0][m] if side else axes[block * rows_per_block + m][col]
                    ax.set_xticks([])
                    ax.set_yticks([])
                    if m > 0:
                        ax.axis("off")
                    else:
                        ax.set_title(panel, fontsize=8)
                        ax.text(0.5, 0.5, "\n".join(textwrap.wrap(why, 40)), ha="center", va="center", fontsize=8)
                continue
            metrics = [("time_s", "forward + backward (s)")] + ([("peak_mb", "peak memory (MB)")] if memory else [])
            for m, (key, ylabel) in enumerate(metrics):
                ax = axes[0][m] if side else axes[block * rows_per_block + m][col]
                sizes = sorted({size_value(r) for r in good})
                present = [lb for lb in labels if any(r["label"] == lb for r in inside)]
                if len(sizes) == 1:  # one size: a bar per implementation
                    for i, label in enumerate(present):
                        vals = [r[key] for r in good if r["label"] == label and r.get(key)]
                        if vals:
                            bar = ax.bar(i, vals[0], color=colours[label])
                            handles.setdefault(label, bar)
                        else:
                            status = str(next((r.get("status") for r in inside if r["label"] == label), ""))
                            ax.text(
                                i,
                                0.5,
                                {"oom": "out of memory", "capped": "over time"}.get(status, status),
                                rotation=90,
                                ha="center",
                                va="bottom",
                                fontsize=7,
                                transform=ax.get_xaxis_transform(),
                            )
                    if key == "time_s":  # each case's own bound, timed beside it, over its bar, and the ratio
                        for i, label in enumerate(present):
                            own = [r["bound_s"] for r in good if r["label"] == label and "bound_s" in r]
                            if own:
                                line = ax.hlines(own[0], i - 0.45, i + 0.45, colors="k", linestyles="--")
                                handles.setdefault("the bound, timed alternately", line)
                            ratios = [r for r in good if r["label"] == label and r.get("ratio")]
                            if ratios:
                                text = f"{ratios[0]['ratio']:.2f}x the bound"
                                ax.text(i, ratios[0][key], text, ha="center", va="bottom", fontsize=7)
                    ax.set_xticks(range(len(present)))
                    ax.set_xticklabels([""] * len(present))
                    ax.set_xlabel(f"size {sizes[0]}")
                    ax.set_ylim(bottom=0)  # bars from zero: their heights compare
                else:
                    for label in present:
                        pts = sorted((size_value(r), r[key]) for r in good if r["label"] == label and r.get(key))
                        if not pts:
                            continue
                        style = "--" if "bound" in label.lower() else "-"
                        (line,) = ax.plot(
                            [x for x, _ in pts], [y for _, y in pts], style, marker="o", color=colours[label]
                        )
                        handles.setdefault(label, line)
                    if key == "time_s":
                        bound = sorted({(size_value(r), r["bound_s"]) for r in good if "bound_s" in r})
                        if bound and not any("bound" in lb.lower() for lb in present):
                            (line,) = ax.plot([b[0] for b in bound], [b[1] for b in bound], "k--", marker="x")
                            handles.setdefault("three GEMMs (the bound)", line)
                    ax.set_xscale("log")
                    ax.set_yscale("log")
                    ax.set_xticks(sizes)  # the sizes run, as plain numbers
                    ax.set_xticklabels([str(x) for x in sizes], fontsize=7)
                    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
                    x_param = next((r["x"] for r in good if r.get("x")), None)
                    ax.set_xlabel(
                        AXIS_LABELS.get(x_param, str(x_param))
                        if x_param
                        else "n"
                        if good[0]["workload"] == "neighbor"
                        else "batch size B"
                    )
                ax.set_ylabel(ylabel, fontsize=8)
                ax.grid(True, which="both", alpha=0.3)
                if m == 0:
                    finding = panel_finding(inside)
                    ax.set_title("\n".join([panel] + textwrap.wrap(finding, 60)), fontsize=8)
        for block_row in range(0 if side else blocks * rows_per_block):
            for col in range(cols):
                if (block_row // rows_per_block) * cols + col >= len(panels):
                    axes[block_row][col].axis("off")
        fig.legend(
            list(handles.values()), list(handles.keys()), loc="lower center", ncol=min(5, len(handles)), fontsize=8
        )
        fig.suptitle(f"flashcl bench: {suite}")
        legend_rows = (len(handles) + 4) // 5
        fig.tight_layout(rect=(0, 0.035 * legend_rows + 0.02, 1, 0.97))
        path = os.path.join(out_dir, f"{suite}.png")
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths
