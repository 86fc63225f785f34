"""`pagoda-operator render | run | crds | docs`: the operator's command line.

render  print the manifests the operator would apply for InferenceService file(s), as a YAML
        stream, or the validation problems on stderr with exit status 1
run     start the operator (kopf) in or out of a cluster
crds    write the CRD YAML generated from the schema (crds/ and the chart's crds/)
docs    write the InferenceService field reference generated from the schema (docs/operator.md)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

from pagoda_operator import crd, docs
from pagoda_operator.render import Images, NetworkPeers, render
from pagoda_operator.spec import API_VERSION, KIND
from pagoda_operator.validation import check


class _Dumper(yaml.SafeDumper):
    """Block-style multi-line strings (the download script, engine.json) for readable output."""


def _str_representer(dumper: yaml.SafeDumper, data: str) -> yaml.Node:
    style = "|" if "\n" in data else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", data, style=style)


_Dumper.add_representer(str, _str_representer)


def dump_manifests(manifests: list[dict]) -> str:
    return yaml.dump_all(manifests, Dumper=_Dumper, sort_keys=False, explicit_start=True, width=120)


def _load_documents(path: str) -> list[dict]:
    text = sys.stdin.read() if path == "-" else Path(path).read_text()
    return [doc for doc in yaml.safe_load_all(text) if doc]


def cmd_render(args: argparse.Namespace) -> int:
    try:
        documents = _load_documents(args.filename)
    except (OSError, yaml.YAMLError) as e:
        print(f"pagoda-operator render: cannot read {args.filename}: {e}", file=sys.stderr)
        return 2
    services = [d for d in documents if isinstance(d, dict) and d.get("kind") == KIND]
    if not services:
        print(f"pagoda-operator render: no {KIND} ({API_VERSION}) in {args.filename}", file=sys.stderr)
        return 2
    images = Images.from_env()
    peers = _network_peers("render")
    if peers is None:
        return 2
    manifests: list[dict] = []
    failed = False
    for body in services:
        body.setdefault("metadata", {})
        if args.namespace:
            body["metadata"]["namespace"] = args.namespace
        if body.get("apiVersion") != API_VERSION:
            print(f"pagoda-operator render: apiVersion must be {API_VERSION}, got {body.get('apiVersion')!r}", file=sys.stderr)
            failed = True
            continue
        checked = check(body)
        if not checked.ok:
            name = body["metadata"].get("name", "?")
            print(f"InferenceService {name!r} is invalid:", file=sys.stderr)
            for problem in checked.problems:
                print(f"  - {problem}", file=sys.stderr)
            failed = True
            continue
        manifests += render(body, checked.spec, images, peers)
    if failed:
        return 1
    sys.stdout.write(dump_manifests(manifests))
    return 0


def cmd_crds(args: argparse.Namespace) -> int:
    if args.check:
        stale = [
            str(directory / name)
            for directory, files in ((args.out, crd.expected_files(True)), (args.chart, crd.expected_files(False)))
            if directory is not None
            for name, text in files.items()
            if not (directory / name).is_file() or (directory / name).read_text() != text
        ]
        for path in stale:
            print(f"stale: {path} (run `make crds`)", file=sys.stderr)
        return 1 if stale else 0
    for path in crd.write(args.out, args.chart):
        print(path)
    return 0


def cmd_docs(args: argparse.Namespace) -> int:
    if args.check and args.file is None:
        print("pagoda-operator docs: --check needs the file to check, e.g. docs/operator.md", file=sys.stderr)
        return 2
    if args.file is None:
        sys.stdout.write(docs.render_reference())
        return 0
    try:
        if args.check:
            if docs.is_current(args.file):
                return 0
            print(f"stale: {args.file} (run `pagoda-operator docs {args.file}`)", file=sys.stderr)
            return 1
        if docs.write(args.file):
            print(args.file)
        return 0
    except (OSError, ValueError) as e:
        print(f"pagoda-operator docs: {args.file}: {e}", file=sys.stderr)
        return 2


def _network_peers(verb: str) -> NetworkPeers | None:
    """The installation's NetworkPolicy peers from the environment; None (said on stderr) when a
    variable holds no valid value."""
    try:
        return NetworkPeers.from_env()
    except ValueError as e:
        print(f"pagoda-operator {verb}: {e}", file=sys.stderr)
        return None


def cmd_run(args: argparse.Namespace) -> int:
    from pagoda_operator import handlers  # kopf and the Kubernetes client only when running

    if _network_peers("run") is None:
        return 2  # refused before it starts, not at each reconcile

    return handlers.run_operator(
        namespaces=args.namespace or [],
        clusterwide=args.all_namespaces or not args.namespace,
        standalone=args.standalone,
        liveness=args.liveness,
        verbosity=args.verbosity,
        metrics_port=args.metrics_port,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagoda-operator", description="Pagoda's Kubernetes operator")
    sub = parser.add_subparsers(dest="verb", required=True)

    p = sub.add_parser("render", help="print the manifests for an InferenceService file")
    p.add_argument("-f", "--filename", required=True, help="YAML file with InferenceService(s); - for stdin")
    p.add_argument("-n", "--namespace", default=None, help="render into this namespace (default: the file's, else default)")
    p.set_defaults(func=cmd_render)

    p = sub.add_parser("run", help="run the operator")
    scope = p.add_mutually_exclusive_group()
    scope.add_argument("--namespace", action="append", help="watch this namespace (repeatable; kopf globs allowed)")
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="watch all namespaces (the default)")
    p.add_argument("--standalone", action="store_true", help="no peering with other operator instances")
    p.add_argument("--liveness", default=None, help="liveness endpoint, e.g. http://0.0.0.0:8080/healthz")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="serve the operator's Prometheus metrics (the autoscaler's decisions) on this port at /metrics")
    level = p.add_mutually_exclusive_group()
    for name in ("quiet", "verbose", "debug"):
        level.add_argument(f"--{name}", dest="verbosity", action="store_const", const=name)
    p.set_defaults(func=cmd_run, verbosity="info")

    p = sub.add_parser("crds", help="write the generated CRD YAML")
    p.add_argument("--out", type=Path, required=True, help="directory for the CRD and its kustomization.yaml")
    p.add_argument("--chart", type=Path, default=None, help="the Helm chart's crds/ directory")
    p.add_argument("--check", action="store_true", help="only check the files are up to date (exit 1 if stale)")
    p.set_defaults(func=cmd_crds)

    p = sub.add_parser("docs", help="write the InferenceService field reference generated from the schema")
    p.add_argument("file", type=Path, nargs="?", default=None,
                   help="Markdown file whose generated section is rewritten (docs/operator.md); "
                        "omitted: print the section")
    p.add_argument("--check", action="store_true", help="only check the file is up to date (exit 1 if stale)")
    p.set_defaults(func=cmd_docs)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
