"""``flashcl bench``: runs the suites, prints tables, writes JSON and Markdown."""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
from typing import Any, Dict, List, Optional

import torch

from .measure import measure

Row = Dict[str, Any]


def _machine() -> Dict[str, Any]:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=os.path.dirname(__file__)).stdout.strip()
    except OSError:
        rev = ""
    return {"cpu": cpu, "cores": os.cpu_count(), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "python": platform.python_version(), "git": rev,
            "date": datetime.datetime.now().isoformat(timespec="seconds")}


def _progress(total: int):
    try:
        from tqdm import tqdm
        return tqdm(total=total, unit="case", leave=False)
    except ImportError:
        return None


def tiled_targets(quick: bool) -> List[Dict[str, Any]]:
    """The cases of the tiled backend's targets (issue: "Tiled backend"). Each
    case's ratio is to its bound timed alternately in the same process."""
    b, d = (512, 64) if quick else (8192, 768)
    big_b, big_d = (4096, 32) if quick else (65536, 256)
    n_big = 1500 if quick else 20000
    n_small = 200 if quick else 2000
    gemm = {"workload": "gemm3", "params": {"B": b, "D": d}}
    cases: List[Dict[str, Any]] = []
    for impl in ("flashcl-tiled", "flashcl-dense", "pml"):
        cases.append({"group": "supcon", "label": impl, "workload": "supcon", "bound": gemm,
                      "params": {"B": b, "D": d, "classes": 5, "impl": impl}})
    # The second seed's formula (denominator includes self, positives summed):
    # its vectorised loss and flashcl with the options that reproduce it.
    for impl in ("seed2-vectorized", "flashcl-tiled"):
        cases.append({"group": "supcon", "label": f"{impl} (seed-2 formula)", "workload": "supcon", "bound": gemm,
                      "params": {"B": b, "D": d, "classes": 5, "impl": impl, "seed2": True}})
    cases.append({"group": "supcon-big", "label": "flashcl-tiled", "workload": "supcon", "repeats": 0,
                  "params": {"B": big_b, "D": big_d, "classes": 5, "impl": "flashcl-tiled"}})
    for impl in ("flashcl-tiled", "flashcl-dense", "torch-ce"):
        cases.append({"group": "clip", "label": impl, "workload": "clip", "bound": gemm,
                      "params": {"B": b, "D": d, "impl": impl}})
    for n, group in ((n_big, "neighbor-big"), (n_small, "neighbor-small")):
        gather = {"workload": "neighbor", "params": {"n": n, "k": 2, "impl": "gather-fix"}}
        impls = ("log-form", "stable-logsumexp", "flashcl-tiled") if group == "neighbor-big" else (
            "seed-program", "flashcl-tiled")
        for impl in impls:
            seed = impl == "seed-program"
            cases.append({"group": group, "label": impl, "workload": "neighbor", "bound": gather,
                          "repeats": 1 if seed else (2 if group == "neighbor-big" else 5),
                          "params": {"n": n, "k": 2, "impl": impl}})
    return cases


SUITES = {"tiled": tiled_targets}


def run_cases(cases: List[Dict[str, Any]], cap_s: float, mem_limit_mb: Optional[int]) -> List[Row]:
    bar = _progress(len(cases))
    rows = []
    for case in cases:
        if bar is not None:
            bar.set_description(f"{case['group']}: {case['label']}")
        res = measure(case["workload"], case["params"], repeats=case.get("repeats", 2), cap_s=cap_s,
                      mem_limit_mb=mem_limit_mb, bound=case.get("bound"))
        rows.append({**case, **res})
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    _add_ratios(rows)
    return rows


def _add_ratios(rows: List[Row]) -> None:
    """Memory above inputs and gradient (the ratio to the bound comes from the child)."""
    for r in rows:
        if r.get("status") != "ok":
            continue
        r["extra_mb"] = r["peak_mb"] - r.get("grad_mb", 0.0)
        if r["workload"] == "neighbor":
            r["peak_over_input"] = r["peak_mb"] / (r["params"]["n"] ** 2 * 4 / 2**20)


def _fmt(r: Row) -> List[str]:
    size = ", ".join(f"{k}={v}" for k, v in r["params"].items() if k not in ("impl", "classes"))
    if r.get("status") != "ok":
        return [r["group"], r["label"], size, r.get("status", "?"), "", "", "", ""]
    ratio = f"{r['ratio']:.2f}x ({r['bound_s'] * 1e3:.0f} ms)" if "ratio" in r else ""
    over = f"{r['peak_over_input']:.2f}x input" if "peak_over_input" in r else f"{r['extra_mb']:.0f} MB"
    steady = f" / {r['steady_peak_mb']:.0f}" if r.get("steady_peak_mb") is not None else ""
    return [r["group"], r["label"], size, f"{r['time_s'] * 1e3:.1f} ms", ratio, f"{r['peak_mb']:.0f}{steady} MB", over,
            f"{r['loss']:.5g}" if r["workload"] != "gemm3" else ""]


HEADER = ["group", "implementation", "size", "fwd+bwd", "vs bound (bound)", "peak mem (first / steady)", "beyond grad",
          "loss"]


def markdown(rows: List[Row], machine: Dict[str, Any], command: str) -> str:
    lines = [f"Measured {machine['date']} on {machine['cpu']} ({machine['threads']} threads), "
             f"torch {machine['torch']}, flashcl {machine['git']}: `{command}`", "",
             "| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(_fmt(r)) + " |" for r in rows]
    lines += ["", "vs bound: best time over the best time of the bound, timed alternately in the same "
              "process: the three GEMMs no exact loss can avoid (S = E E^T, G E, G^T E; torch.mm into "
              "preallocated outputs), or the seed's gather fix for the neighbour loss. peak mem: peak resident "
              "memory of the first call above what was resident before it (this includes one-time costs "
              "such as MKL's GEMM workspace, ~15 MB), then of a later call (steady state). beyond grad: "
              "first-call peak minus the inputs' gradient (for the neighbour loss: peak over the input's "
              "size). fwd+bwd: best of the repeats."]
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--suite", choices=sorted(SUITES), action="append",
                   help="suite(s) to run (default: all)")
    p.add_argument("--quick", action="store_true", help="tiny sizes (seconds), for tests")
    p.add_argument("--out", default="bench-results", help="folder for results.json and report.md")
    p.add_argument("--cap", type=float, default=120.0, help="seconds per case before it is reported as capped")
    p.add_argument("--mem-limit-mb", type=int, default=16384,
                   help="address-space allowance per case; beyond it a case is reported as oom")


def run(args: argparse.Namespace) -> int:
    machine = _machine()
    suites = args.suite or sorted(SUITES)
    all_rows: List[Row] = []
    for name in suites:
        rows = run_cases(SUITES[name](args.quick), args.cap, args.mem_limit_mb)
        for r in rows:
            r["suite"] = name
        all_rows += rows
    command = "flashcl bench " + " ".join(
        (["--quick"] if args.quick else []) + [f"--suite {s}" for s in (args.suite or [])])
    report = markdown(all_rows, machine, command.strip())
    print(report)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"machine": machine, "rows": all_rows}, f, indent=1)
    with open(os.path.join(args.out, "report.md"), "w") as f:
        f.write(report + "\n")
    return 0
