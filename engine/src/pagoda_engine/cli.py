"""`pagoda serve | route | epp | bench | version`: one entry point, each verb owned by its module."""

from __future__ import annotations

import argparse
import importlib
import sys

# verb -> module exposing add_arguments(parser) and run(args) -> int
_VERBS = {
    "serve": ("pagoda_engine.serve", "OpenAI-compatible server for one engine"),
    "route": ("pagoda_engine.router.app", "OpenAI-compatible router in front of engine replicas"),
    "epp": ("pagoda_engine.router.epp", "Gateway API inference extension Endpoint Picker (Envoy ext_proc over gRPC)"),
    "bench": ("pagoda_engine.bench", "benchmarks: throughput, latency, serve, multiturn, kv-share"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagoda", description="Pagoda: LLM serving on Kubernetes")
    sub = parser.add_subparsers(dest="verb", required=True)
    for verb, (module_name, help_text) in _VERBS.items():
        p = sub.add_parser(verb, help=help_text)
        p.set_defaults(_module=module_name)
        importlib.import_module(module_name).add_arguments(p)
    sub.add_parser("version", help="print the version")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["version"] or argv[:1] == ["--version"]:
        from pagoda_engine import __version__

        print(__version__)
        return 0
    args = build_parser().parse_args(argv)
    return int(importlib.import_module(args._module).run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
