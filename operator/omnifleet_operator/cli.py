"""The `omnifleet` command. Subcommands import their heavy parts lazily, so
`omnifleet master` never loads kopf and `omnifleet render` never loads ZMQ, and a
pod's process takes SIGTERM before it imports anything heavy (see main)."""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path
from typing import Any

USAGE = """omnifleet COMMAND [ARGS]

  validate -f FILE [PATH=VALUE ...]   check pipeline files; every problem with its field path, and that
                       the entrypoints and input processors they name exist (where installed)
  render -f FILE [PATH=VALUE ...]     print the Kubernetes objects the operator would apply
  crd [-o FILE]        print (or write) the generated CustomResourceDefinition
  import vllm-omni FILE [--pipeline NAME] [--name NAME] [--model M] [--no-async-chunk]
                       a vLLM-Omni deploy file as an OmniPipeline (stdout), or why not
  dashboard [-f FILE] [-o OUT]  the Grafana dashboard (of one pipeline with -f)
  operator [ARGS]      run the operator (kopf) against the current kubeconfig
  run -f FILE [PATH=VALUE ...]        run a pipeline locally as plain processes
                       (PATH=VALUE: overrides of the spec, e.g. stages.talker.replicas=2)
  master ARGS          run a pipeline's master (in its pod)
  stage ARGS           run one stage process group (in its pod)
  dev up|down|status|images  a local cluster (real node + fake GPU nodes) with the operator in it
"""


def load_documents(path: str) -> list[tuple[str, Any]]:
    """(label, document) for each YAML document in a file ('-' is stdin)."""
    import yaml

    text = sys.stdin.read() if path == "-" else Path(path).read_text()
    try:
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as err:
        raise SystemExit(f"{path}: not valid YAML: {err}") from None
    if not docs:
        raise SystemExit(f"{path}: no documents")
    return [(path if len(docs) == 1 else f"{path}#{i}", d) for i, d in enumerate(docs)]


def with_overrides(doc: Any, overrides: list[str]) -> Any:
    from .overrides import OverrideError, apply_overrides

    try:
        return apply_overrides(doc, overrides)
    except OverrideError as e:
        raise SystemExit(f"omnifleet: {e}") from None


def cmd_validate(args: argparse.Namespace) -> int:
    from .checks import Policy, check_callables, check_document

    failed = 0
    for path in args.file:
        for label, doc in load_documents(path):
            parsed, problems = check_document(with_overrides(doc, args.overrides), Policy.from_flags(args))
            unchecked: list[str] = []
            if parsed is not None and not args.no_import:
                problems, unchecked = check_callables(parsed)
            if problems:
                failed += 1
                print(f"{label}: invalid, {len(problems)} problem(s)", file=sys.stderr)
                for p in problems:
                    print(f"  {p}", file=sys.stderr)
            else:
                s = parsed.spec
                print(f"{label}: valid: pipeline {parsed.metadata.name!r}, {len(s.stages)} stage(s), "
                      f"{len(s.hosts())} pod group(s)")
                for line in unchecked:
                    print(f"  not checked: {line}")
    return 1 if failed else 0


def cmd_render(args: argparse.Namespace) -> int:
    from .checks import Policy, check_document
    from .render import desired

    out = []
    for label, doc in load_documents(args.file):
        parsed, problems = check_document(with_overrides(doc, args.overrides), Policy.from_flags(args))
        if problems:
            for p in problems:
                print(f"{label}: {p}", file=sys.stderr)
            return 1
        if args.namespace:
            parsed = parsed.model_copy(update={"metadata": parsed.metadata.model_copy(
                update={"namespace": args.namespace})})
        out += desired(parsed)
    from .yamlfmt import dump_all

    sys.stdout.write(dump_all(out))
    return 0


def cmd_crd(args: argparse.Namespace) -> int:
    from .crd import crd_yaml

    text = crd_yaml()
    if args.output:
        Path(args.output).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    import yaml

    from .vllm_omni.importer import import_deploy

    if not Path(args.file).is_file():
        print(f"omnifleet import: {args.file}: no such file", file=sys.stderr)
        return 2
    result = import_deploy(args.file, pipeline=args.pipeline, name=args.name, model=args.model,
                           version=args.vllm_omni_version, async_chunk=args.async_chunk)
    for w in result.warnings:
        print(f"warning: {w}", file=sys.stderr)
    if result.document is None:
        for r in result.refusals:
            print(f"refused: {r}", file=sys.stderr)
        return 1
    sys.stdout.write(yaml.safe_dump(result.document, sort_keys=False, width=120))
    return 0


def cmd_dashboard(args: argparse.Namespace) -> int:
    from .checks import check_document
    from .dashboard import dashboard_json

    doc = None
    if args.file:
        (label, raw), *more = load_documents(args.file)
        doc, problems = check_document(raw)
        if problems or more:
            for p in problems:
                print(f"{label}: {p}", file=sys.stderr)
            if more:
                print(f"{args.file}: holds {len(more) + 1} documents; give one pipeline", file=sys.stderr)
            return 1
    text = dashboard_json(doc)
    if args.output:
        Path(args.output).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


# The commands that run as a pod's container process, which is PID 1 in the container: the kernel delivers
# SIGTERM to PID 1 only through a handler, so a pod deleted while its process still starts would ignore the
# kubelet's SIGTERM, go on to load and serve, and die by SIGKILL at the end of the grace period.
POD_COMMANDS = ("master", "stage", "operator")


def _exit(signum: int, frame: Any) -> None:
    sys.exit(0)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd in POD_COMMANDS:
        # Until the command installs its own handler (which drains), SIGTERM ends it: nothing is accepted yet.
        signal.signal(signal.SIGTERM, _exit)
    # Commands that own their argument parsing.
    if cmd == "master":
        from omnifleet_runtime.commands import master
        return master(rest)
    if cmd == "stage":
        from omnifleet_runtime.commands import stage
        return stage(rest)
    if cmd == "run":
        from .localrun import main as run_main
        return run_main(rest)
    if cmd == "operator":
        from .handlers import main as operator_main
        return operator_main(rest)
    if cmd == "dev":
        from .devcluster.commands import main as dev_main
        return dev_main(rest)

    from .checks import add_policy_flags

    parser = argparse.ArgumentParser(prog="omnifleet", usage=USAGE)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("validate")
    p.add_argument("-f", "--file", action="append", required=True, help="pipeline file (repeatable, '-' for stdin)")
    p.add_argument("--no-import", action="store_true",
                   help="do not import the entrypoints and input processors to check that they exist")
    p.add_argument("overrides", nargs="*", metavar="PATH=VALUE", help="override of the spec (stages.NAME.FIELD=VALUE)")
    add_policy_flags(p)  # the operator's flags: validate answers as an operator started with them would
    p.set_defaults(func=cmd_validate)
    p = sub.add_parser("render")
    p.add_argument("-f", "--file", required=True)
    p.add_argument("-n", "--namespace", help="namespace of the pipeline (default: its own, else 'default')")
    p.add_argument("overrides", nargs="*", metavar="PATH=VALUE", help="override of the spec (stages.NAME.FIELD=VALUE)")
    add_policy_flags(p)
    p.set_defaults(func=cmd_render)
    p = sub.add_parser("import", help="convert another system's pipeline file")
    p.add_argument("source", choices=["vllm-omni"], help="the system the file comes from")
    p.add_argument("file", help="a vLLM-Omni deploy YAML (its base_config files beside it)")
    p.add_argument("--pipeline", help="vLLM-Omni pipeline registry key (default: the file's `pipeline:`, "
                   "the pipeline whose default deploy file it is, or the file name's)")
    p.add_argument("--name", help="metadata.name of the OmniPipeline (default: from the file name)")
    p.add_argument("--model", help="spec.model (a deploy file names none)")
    p.add_argument("--vllm-omni-version", default="0.30.0", help="vLLM-Omni version the file is for")
    p.add_argument("--async-chunk", action=argparse.BooleanOptionalAction, default=None,
                   help="override the file's async_chunk (as vLLM-Omni's flag of that name); --no-async-chunk: "
                   "stages hand over whole outputs (default: the file's)")
    p.set_defaults(func=cmd_import)
    p = sub.add_parser("crd")
    p.add_argument("-o", "--output")
    p.set_defaults(func=cmd_crd)
    p = sub.add_parser("dashboard")
    p.add_argument("-f", "--file", help="a pipeline: its name and stages become the dashboard's defaults")
    p.add_argument("-o", "--output")
    p.set_defaults(func=cmd_dashboard)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
