"""``flashcl`` / ``python -m flashcl``: the command line."""
from __future__ import annotations

import argparse
import sys
from typing import List, Optional


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="flashcl", description="flashcl command line")
    sub = parser.add_subparsers(dest="command", required=True)
    from .bench.cli import add_arguments

    add_arguments(sub.add_parser("bench", help="run the benchmarks (time and peak memory)"))
    args = parser.parse_args(argv)
    if args.command == "bench":
        from .bench.cli import run

        return run(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
