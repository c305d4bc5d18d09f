"""The `omnimtp` command line: one subcommand per job.

Each subcommand's parser and handler live next to the code they drive; this module only wires them up.
Parsers are built from light modules only (no torch, transformers or server stack): `--help` and a usage
error answer at once, and each handler imports what it runs. Ctrl-C and SIGTERM stop any command with one
line (`omnimtp speak: stopped (SIGINT)`, exit status 128 + the signal), never a traceback.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from omnimtp import __version__
from omnimtp.argtypes import HelpFormatter
from omnimtp.console import interrupt_on_signals, quiet_expected_warnings, quiet_progress_bars, stopped_by


class _Parser(argparse.ArgumentParser):
    """Every (sub)command shows its flags' defaults (`HelpFormatter`)."""

    def __init__(self, *args, formatter_class=HelpFormatter, **kwargs):
        super().__init__(*args, formatter_class=formatter_class, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    from omnimtp import batch, quantize_cli, speak_cli, transcribe_cli, voice_cli
    from omnimtp.mtp import train_cli
    from omnimtp.server import cli as server_cli
    from omnimtp.spec_decode import cli as spec_cli

    parser = _Parser(prog="omnimtp", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"omnimtp {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    # Subcommands register here (each module exposes `add_parser(subparsers)` that sets `handler`).
    for module in (speak_cli, voice_cli, transcribe_cli, train_cli, spec_cli, server_cli, batch, quantize_cli):
        module.add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    quiet_expected_warnings()
    quiet_progress_bars()
    is_main_thread = threading.current_thread() is threading.main_thread()
    previous = (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) if is_main_thread else None
    if is_main_thread:
        interrupt_on_signals()
    try:
        return int(args.handler(args) or 0)
    except ValueError as exc:  # bad input, named by the code that found it: a message, not a traceback
        print(f"omnimtp {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:  # Ctrl-C or SIGTERM: one line, no traceback
        signum = stopped_by(exc)
        print(f"omnimtp {args.command}: stopped ({signum.name})", file=sys.stderr)
        return 128 + signum
    finally:
        if is_main_thread:
            for signum, handler in zip((signal.SIGINT, signal.SIGTERM), previous, strict=True):
                signal.signal(signum, signal.SIG_DFL if handler is None else handler)


if __name__ == "__main__":
    sys.exit(main())
