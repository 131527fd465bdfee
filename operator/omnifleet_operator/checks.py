"""All checks of a pipeline document: the schema's, the operator's own (object names), the
platform's policy (what the operator is started to allow), and, for the CLI only, that the
callables it names exist.

The operator never imports user code; `omnifleet validate` does, where the
code is installed, so a sample or a file naming a function that does not
exist fails before it reaches a cluster.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from typing import Any

from omnifleet_runtime.schema import OmniPipeline
from omnifleet_runtime.validate import Problem, parse_pipeline

from .names import check_names


@dataclass(frozen=True)
class Policy:
    """What a platform team allows pipelines to ask for; refused by default.

    hostPath volumes reach into a node's filesystem; LoadBalancer and
    NodePort Services expose the master outside the cluster network. Both
    are the platform's decision, not each pipeline author's.
    """

    allow_host_path: bool = False
    allow_external_service: bool = False

    @classmethod
    def from_flags(cls, args: Any) -> "Policy":
        return cls(allow_host_path=args.allow_host_path, allow_external_service=args.allow_external_service)


PERMISSIVE = Policy(allow_host_path=True, allow_external_service=True)


def add_policy_flags(parser: Any) -> None:
    parser.add_argument("--allow-host-path", action="store_true",
                        help="accept spec.modelVolume.hostPath (a node directory) (default: refused)")
    parser.add_argument("--allow-external-service", action="store_true",
                        help="accept spec.master.serviceType LoadBalancer or NodePort (default: refused)")


def check_policy(doc: OmniPipeline, policy: Policy) -> list[Problem]:
    out = []
    mv = doc.spec.model_volume
    if mv is not None and mv.host_path is not None and not policy.allow_host_path:
        out.append(Problem("spec.modelVolume.hostPath", "hostPath volumes are refused by this operator (it runs "
                           "without --allow-host-path); use claimName (a PersistentVolumeClaim)"))
    service_type = doc.spec.master.service_type
    if service_type != "ClusterIP" and not policy.allow_external_service:
        out.append(Problem("spec.master.serviceType", f"{service_type} is refused by this operator (it runs "
                           "without --allow-external-service); use ClusterIP behind an Ingress or Gateway"))
    return out


def check_document(doc: Any, policy: Policy = Policy()) -> tuple[OmniPipeline | None, list[Problem]]:
    """The parsed pipeline (None when invalid) and every problem found."""
    parsed, problems = parse_pipeline(doc)
    if parsed is not None:
        problems = problems + check_names(parsed) + check_policy(parsed, policy)
    return (None if problems else parsed), problems


def check_callables(doc: OmniPipeline) -> tuple[list[Problem], list[str]]:
    """Import every entrypoint, input processor and prompt expansion the pipeline names.

    Returns the problems (a module that exists without the callable, or a
    callable that is not callable) and, as plain lines, what could not be
    checked here (a module that is not installed, or fails to import).
    """
    problems: list[Problem] = []
    unchecked: list[str] = []
    for i, stage in enumerate(doc.spec.stages):
        for field, ref in (("entrypoint", stage.entrypoint), ("inputProcessor", stage.input_processor),
                           ("promptExpand", stage.prompt_expand)):
            if not ref:
                continue
            path = f"spec.stages[{i}].{field}"
            module_name, _, attr = ref.partition(":")
            try:
                found = importlib.util.find_spec(module_name)
            except (ImportError, ValueError):
                found = None
            if found is None:
                unchecked.append(f"{path}: {ref} (module {module_name!r} is not installed here)")
                continue
            try:
                obj: Any = importlib.import_module(module_name)
            except Exception as e:  # noqa: BLE001 - any import failure means "cannot check here"
                unchecked.append(f"{path}: {ref} (importing {module_name!r} failed: {type(e).__name__}: {e})")
                continue
            for part in attr.split("."):
                if not hasattr(obj, part):
                    problems.append(Problem(path, f"{module_name!r} has no {attr!r}"))
                    break
                obj = getattr(obj, part)
            else:
                if not callable(obj):
                    problems.append(Problem(path, f"{ref} is not callable"))
    return problems, unchecked
