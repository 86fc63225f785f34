"""What `pagoda route` and `pagoda epp` do alike as processes: log set-up, the refusal of bad
flags (exit 2, the message naming the flag on stderr) and `python -m` entry points that build the
verb's own parser."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable


def start_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per proxied request or poll otherwise


def refused(prog: str, validate: Callable[[argparse.Namespace], None], args: argparse.Namespace,
            errors: tuple[type[Exception], ...]) -> bool:
    """Runs `validate(args)`; True (the message on stderr) when it raised one of `errors`."""
    try:
        validate(args)
    except errors as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return True
    return False


def main(prog: str, description: str, add_arguments: Callable[[argparse.ArgumentParser], None],
         run: Callable[[argparse.Namespace], int], argv: list[str] | None) -> int:
    """`python -m pagoda_engine.router.<verb> ...`: the verb alone, with the flags `pagoda <verb>` has."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    add_arguments(parser)
    return run(parser.parse_args(argv))
