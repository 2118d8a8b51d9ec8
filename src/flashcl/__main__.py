"""``flashcl`` / ``python -m flashcl``: the command line (``bench``, ``doctor``, ``check``)."""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from typing import Any, Callable, List, Optional


def _load_function(target: str) -> Callable[..., Any]:
    path, sep, name = target.rpartition(":")
    if not sep or not path or not name:
        raise SystemExit(f"flashcl doctor: expected path/to/file.py:function, got {target!r}")
    if not os.path.exists(path):
        raise SystemExit(f"flashcl doctor: no such file: {path}")
    spec = importlib.util.spec_from_file_location("_flashcl_doctor_target", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fn = getattr(module, name, None)
    if not callable(fn):
        raise SystemExit(f"flashcl doctor: {path} has no function {name!r}")
    return fn


def _positional_parameters(fn: Callable[..., Any]) -> Optional[int]:
    """How many positional parameters without a default ``fn`` takes (None: *args)."""
    import inspect

    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return None
    return sum(1 for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty)


def _doctor(args: argparse.Namespace) -> int:
    from .tools.doctor import doctor, inputs_from_shapes

    fn = _load_function(args.target)
    try:
        sizes = [int(s) for s in args.sizes.split(",")]
    except ValueError as e:
        raise SystemExit(f"flashcl doctor: --sizes must be comma-separated ints, got {args.sizes!r}") from e
    try:
        inputs = inputs_from_shapes(args.shape, sizes[0], seed=args.seed)
    except ValueError as e:
        raise SystemExit(f"flashcl doctor: {e}") from e
    _without_grad(fn, inputs, args.no_grad or [])
    params = _positional_parameters(fn)
    if params is not None and len(args.shape) < params:
        raise SystemExit(
            f"flashcl doctor: {args.target} takes {params} input(s), got {len(args.shape)} --shape: "
            "give one --shape per input, in order (e.g. --shape n,128 --shape n:int:10)"
        )
    candidate = _load_function(args.candidate) if args.candidate else None
    report = doctor(
        fn,
        *inputs,
        sizes=sizes,
        seed=args.seed,
        progress=lambda line: print(f"... {line}", file=sys.stderr, flush=True),
        candidate=candidate,
    )
    print(report)
    if args.json:
        with open(args.json, "w") as f:
            f.write(report.to_json())
        print(f"\nwrote {args.json}")
    return 0


def _without_grad(fn: Callable[..., Any], inputs: List[Any], names: List[str]) -> None:
    """``--no-grad NAME``: the floating inputs named (the function's parameter, or its
    position from 0) made without gradient, in place (ages, soft labels, a frozen tower's
    output), so that the comparison leaves them out."""
    from .tools.doctor import parameter_names

    given = parameter_names(fn, len(inputs)) or []
    for name in names:
        index = int(name) if name.isdigit() else (given.index(name) if name in given else None)
        if index is None or index >= len(inputs):
            raise SystemExit(f"flashcl doctor: --no-grad {name}: not a parameter of the function ({', '.join(given)})")
        if not inputs[index].is_floating_point():
            raise SystemExit(f"flashcl doctor: --no-grad {name}: an integer input has no gradient already")
        inputs[index] = inputs[index].detach()


_DTYPES = ("float64", "float32", "float16", "bfloat16")


def _unusable_device(device: str) -> Optional[str]:
    """Why torch cannot compute on ``device`` (a name it does not know, a backend it was
    not built with or that sees no device, an index past the last device), or None."""
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        return "not a device torch knows; use cpu, cuda or cuda:N"
    if dev.type == "cuda" and not torch.cuda.is_available():
        return "torch sees no CUDA device"
    if dev.type == "meta":
        return "a meta device holds no values to check"
    try:
        torch.ones(1, device=dev).sum().item()
    except (RuntimeError, AssertionError, ValueError) as e:
        return f"this torch cannot compute there ({str(e).splitlines()[0].split('. ')[0]})"
    return None


def _check(args: argparse.Namespace) -> int:
    import torch

    from .tools.selfcheck import HEADER, format_row, run_checks

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    why = _unusable_device(device)
    if why is not None:  # one clear error before any row (exit status 2: a usage error)
        print(f"flashcl check: --device {device!r}: {why}", file=sys.stderr)
        return 2
    dtypes = [getattr(torch, d) for d in (args.dtype or ["float32", "float16", "bfloat16"])]
    where = torch.cuda.get_device_name(device) if device.startswith("cuda") else "CPU"
    print(
        f"flashcl check on {device} ({where}), torch {torch.__version__}: every loss's backends against the "
        "float64 reference on the CPU",
        flush=True,
    )
    print(HEADER, flush=True)
    try:
        rows = run_checks(device, dtypes, args.loss, report=lambda row: print(format_row(row), flush=True))
    except ValueError as e:
        raise SystemExit(f"flashcl check: {e}") from e
    bad = [r for r in rows if r.status in ("FAIL", "error")]
    counts = {s: sum(r.status == s for r in rows) for s in ("pass", "fallback", "n/a", "FAIL", "error")}
    print("\n" + ", ".join(f"{n} {s}" for s, n in counts.items()), flush=True)
    if counts["fallback"]:
        print("fallback: the Triton kernels failed on this device; the tiled backend computed those rows", flush=True)
    return 1 if bad else 0


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="flashcl", description="flashcl command line")
    sub = parser.add_subparsers(dest="command", required=True)
    from .bench.cli import add_arguments

    add_arguments(sub.add_parser("bench", help="run the benchmarks (time and peak memory)"))
    doc = sub.add_parser("doctor", help="diagnose why your own loss function is slow")
    doc.add_argument("target", help="path/to/file.py:function; called as function(*inputs)")
    doc.add_argument(
        "--shape",
        action="append",
        required=True,
        help="repeat once per input, in order: 'n,n' (float, requires grad), 'n,128', 'n:int:5' "
        "(int64 in [0, 5)); n is the batch size. E.g. --shape n,128 --shape n:int:10 for "
        "loss(embeddings, labels)",
    )
    doc.add_argument(
        "--no-grad",
        action="append",
        metavar="NAME",
        help="a floating input without gradient (ages, soft labels, a frozen tower's output): the function's "
        "parameter name or position; repeat for several. Its gradient is then left out of the comparison",
    )
    doc.add_argument("--sizes", default="250,500,1000", help="batch sizes n to run at (default 250,500,1000)")
    doc.add_argument("--seed", type=int, default=0, help="random and torch are seeded with it before each call")
    doc.add_argument("--json", help="also write the report as JSON to this file")
    doc.add_argument(
        "--candidate",
        help="path/to/file.py:function, your replacement (a flashcl.flex_loss call, say) called as the target: "
        "checked against it at every size (value and gradient) and timed against it",
    )
    chk = sub.add_parser(
        "check",
        help="check every loss's backends on your device and dtypes against the float64 reference "
        "(exit status 1 on a mismatch)",
    )
    chk.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda when torch sees one, else cpu)")
    chk.add_argument(
        "--dtype",
        action="append",
        choices=sorted(_DTYPES),
        help="repeat for several (default: float32, float16, bfloat16)",
    )
    chk.add_argument("--loss", action="append", help="only this loss (e.g. supcon_loss); repeat for several")
    args = parser.parse_args(argv)
    if args.command == "check":
        return _check(args)
    if args.command == "bench":
        from .bench.cli import run

        return run(args)
    return _doctor(args)


if __name__ == "__main__":
    sys.exit(main())
