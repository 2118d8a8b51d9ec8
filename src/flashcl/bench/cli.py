"""``flashcl bench``: runs the suites (one child process per case), prints the
tables, writes results.json (every figure and the machine's facts), report.md
and a PNG per suite."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional, Tuple

import torch

from .distbench import measure_dist
from .measure import measure
from .report import markdown, plot
from .suites import DEFAULT_SUITES, SUITES

Row = Dict[str, Any]


def machine_facts(device: str) -> Dict[str, Any]:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=os.path.dirname(__file__)
        ).stdout.strip()
    except OSError:
        rev = ""
    dev = device
    if device.startswith("cuda") and torch.cuda.is_available():
        dev = f"{device} ({torch.cuda.get_device_name(0)})"
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "device": dev,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "git": rev,
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "load_avg": list(os.getloadavg()),
    }


def others_running(samples: int = 5) -> Optional[float]:
    """Other processes' threads running now (``procs_running`` of /proc/stat less this
    process), the mean of a few samples 20 ms apart; None where /proc is absent.
    Sampled while no case runs, it says whether something else competes for the
    cores (a contended run: timings slower than on a quiet machine)."""
    seen = []
    for i in range(samples):
        try:
            with open("/proc/stat") as f:
                line = next(ln for ln in f if ln.startswith("procs_running"))
        except (OSError, StopIteration):
            return None
        seen.append(max(0, int(line.split()[1]) - 1))
        if i + 1 < samples:
            time.sleep(0.02)
    return sum(seen) / len(seen)


def contention(rows: List[Row], machine: Dict[str, Any]) -> Dict[str, Any]:
    """The run's load: the load average at its start and end, the mean of the other
    processes running after its cases (those of the contention suite's deliberately
    busy cases left out), and whether that marks it contended (at least half a
    core's worth of other work on average)."""
    seen = [r["others_running"] for r in rows if r.get("others_running") is not None and not r.get("busy")]
    mean = sum(seen) / len(seen) if seen else None
    return {
        "others_running_mean": mean,
        "contended": mean is not None and mean >= 0.5,
        "load_avg_start": machine.get("load_avg"),
        "load_avg_end": list(os.getloadavg()),
    }


def _progress(total: int) -> Any:
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, unit="case", leave=False)


def run_cases(
    cases: List[Dict[str, Any]],
    cap_s: float,
    mem_limit_mb: Optional[int],
    device: str = "cpu",
    log: Optional[str] = None,
) -> List[Row]:
    """Measures each case in its own child process. With ``stop_after_fail``, an
    implementation that failed (oom, capped) at one size is skipped at larger ones.
    ``log``: a file that gets each row as a JSON line as soon as it is measured, so
    that a run stopped part-way keeps what it measured."""
    bar = _progress(len(cases))
    failed: Dict[str, int] = {}
    rows = []
    for case in cases:
        case = {**case, "params": {**case["params"], "device": device}}
        if bar is not None:
            bar.set_description(f"{case.get('suite', '')} {case['group']}: {case['label']}")
        key = f"{case['group']}/{case['label']}"
        size = case["params"].get("B", case["params"].get("n", 0))
        started = time.perf_counter()
        # a case of the contention suite runs beside processes that keep cores busy
        busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(case.get("busy", 0))]
        try:
            if case.get("stop_after_fail") and key in failed and size > failed[key]:
                res: Dict[str, Any] = {"status": "skipped"}
            elif case["workload"] == "dist":
                res = measure_dist(case["params"], case.get("cap_s") or max(cap_s, 120.0))
            else:
                res = measure(
                    case["workload"],
                    case["params"],
                    repeats=case.get("repeats", 2),
                    cap_s=case.get("cap_s") or cap_s,
                    mem_limit_mb=mem_limit_mb,
                    bound=case.get("bound"),
                )
                if res.get("status") in ("oom", "capped"):
                    failed[key] = min(size, failed.get(key, size))
            others = others_running()
        finally:
            for proc in busy:
                proc.kill()
                proc.wait()
        # the case's whole cost, child start-up included: what the suite's run time is made of
        rows.append({**case, **res, "wall_s": round(time.perf_counter() - started, 3), "others_running": others})
        if log is not None:
            with open(log, "a") as f:
                f.write(json.dumps(rows[-1]) + "\n")
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    return rows


def _seconds(text: str) -> float:
    """A positive, finite number of seconds (``--cap``)."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (0 < value < float("inf")):
        raise argparse.ArgumentTypeError(f"a positive number of seconds, got {text!r}")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--suite",
        choices=sorted(SUITES),
        action="append",
        help=f"suite(s) to run (default: {', '.join(DEFAULT_SUITES)})",
    )
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="tiny sizes (seconds), for tests")
    size.add_argument("--full", action="store_true", help="the larger sizes too (tens of minutes)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    p.add_argument("--out", default="bench-results", help="folder for results.json, report.md and plots")
    p.add_argument(
        "--cap",
        type=_seconds,
        default=None,
        help="seconds of a case's timed calls (its set-up not counted) before it is reported as "
        "capped; given, it replaces every case's own cap (default 10, 120 with --full, longer "
        "for the suites' largest cases)",
    )
    p.add_argument(
        "--mem-limit-mb",
        type=int,
        default=8192,
        help="memory allowance per case above what is in use at its start; past it the case "
        "is reported as out of memory (default 8192)",
    )


def run(args: argparse.Namespace) -> int:
    mode = "quick" if args.quick else "full" if args.full else "default"
    cap = args.cap if args.cap is not None else (120.0 if args.full else 10.0)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(f"--device {args.device}: CUDA is not available here")
        return 2
    machine = machine_facts(args.device)
    suites = args.suite or list(DEFAULT_SUITES)
    cases = [{**case, "suite": name} for name in suites for case in SUITES[name](mode, args.device)]
    if args.cap is not None:  # the user's cap is every case's, a suite's own caps included
        cases = [{**case, "cap_s": args.cap} for case in cases]
    os.makedirs(args.out, exist_ok=True)
    log = os.path.join(args.out, "rows.jsonl")
    open(log, "w").close()
    rows = run_cases(cases, cap, args.mem_limit_mb, args.device, log=log)
    machine.update(contention(rows, machine))
    flags = ["--quick"] if args.quick else ["--full"] if args.full else []
    flags += [f"--suite {s}" for s in (args.suite or [])]
    if args.device != "cpu":
        flags.append(f"--device {args.device}")
    command = " ".join(["flashcl bench"] + flags)
    results: Dict[str, Any] = {
        "machine": machine,
        "command": command,
        "cap_s": cap,
        "mem_limit_mb": args.mem_limit_mb,
        "rows": rows,
        "plots": [],
    }
    # the figures first: a failure in the report or the plots never loses a measured row
    write_results(args.out, results)
    report = markdown(rows, machine, command)
    print(report)
    with open(os.path.join(args.out, "report.md"), "w") as f:
        f.write(report + "\n")
    results["plots"], results["plot_errors"] = plot_each(rows, args.out)
    write_results(args.out, results)
    print(f"\nwrote {args.out}/results.json, {args.out}/report.md" + "".join(f", {p}" for p in results["plots"]))
    for suite, error in results["plot_errors"].items():
        print(f"the {suite} plot failed: {error}", file=sys.stderr)
    return 0


def write_results(out: str, results: Dict[str, Any]) -> None:
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)


def plot_each(rows: List[Row], out: str) -> Tuple[List[str], Dict[str, str]]:
    """Each suite's plot on its own: one that fails is named with its error, the
    others are still drawn."""
    pngs: List[str] = []
    errors: Dict[str, str] = {}
    for suite in dict.fromkeys(r["suite"] for r in rows):
        try:
            pngs += plot([r for r in rows if r["suite"] == suite], out)
        except Exception as e:  # a plot is never worth the run
            errors[suite] = f"{type(e).__name__}: {e}"
    return pngs, errors
