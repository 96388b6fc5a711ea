"""`hisparse` command line. Each subcommand lives in its own module exposing
``add_arguments(parser)`` and ``run(args) -> int``, imported only when chosen (fast `--help`)."""
from __future__ import annotations

import argparse
import importlib
import sys

from vllm_hisparse.config import HiSparseConfigError

# name -> (module, one-line help)
COMMANDS = {
    "sim": ("vllm_hisparse.sim.cli", "replay selection traces through cache policies"),
    "calc": ("vllm_hisparse.bench.calc", "capacity calculator: stock full KV vs hisparse"),
    "demo": ("vllm_hisparse.demo", "run the built-in example"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="hisparse", description="vllm-hisparse tools")
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND")
    for name, (_, text) in COMMANDS.items():
        sub.add_parser(name, help=text, add_help=False)
    if not argv or argv[0] not in COMMANDS:
        p.parse_args(argv)
        p.print_help()
        return 2
    name = argv[0]
    mod = importlib.import_module(COMMANDS[name][0])
    p2 = argparse.ArgumentParser(prog=f"hisparse {name}", description=COMMANDS[name][1])
    mod.add_arguments(p2)
    args = p2.parse_args(argv[1:])
    try:
        return int(mod.run(args) or 0)
    except HiSparseConfigError as e:        # a bad --config: its one line, argparse's exit code
        print(f"hisparse {name}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
