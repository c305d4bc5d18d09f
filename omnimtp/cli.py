"""The `omnimtp` command line: one subcommand per job.

Each subcommand's parser and handler live next to the code they drive; this module only wires them up.
"""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="omnimtp", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", required=True)
    # Subcommands register here (each module exposes `add_parser(subparsers)` that sets `handler`).
    from omnimtp import speak_cli
    speak_cli.add_parser(subparsers)
    from omnimtp.mtp import train_cli
    train_cli.add_parser(subparsers)
    from omnimtp.spec_decode import cli as spec_cli
    spec_cli.add_parser(subparsers)
    from omnimtp.server import cli as server_cli
    server_cli.add_parser(subparsers)
    from omnimtp import batch
    batch.add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.handler(args) or 0)
    except ValueError as exc:  # bad input, named by the code that found it: a message, not a traceback
        print(f"omnimtp {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
