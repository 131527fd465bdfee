"""Names of the objects rendered for a pipeline, and the checks that keep them valid."""

from __future__ import annotations

import re

from omnifleet_runtime import constants as C
from omnifleet_runtime.schema import OmniPipeline
from omnifleet_runtime.validate import Problem

DNS_LABEL_MAX = 63
_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")

MASTER_SUFFIX = "master"
MASTERS_SUFFIX = "masters"  # the headless Service listing every master (stages register with each)
RESERVED_STAGE_NAMES = {MASTER_SUFFIX, MASTERS_SUFFIX, "config", "runtime"}


def master_name(pipeline: str) -> str:
    return f"{pipeline}-{MASTER_SUFFIX}"


def masters_name(pipeline: str) -> str:
    return f"{pipeline}-{MASTERS_SUFFIX}"


def config_name(pipeline: str) -> str:
    return f"{pipeline}-config"


def service_account_name(pipeline: str) -> str:
    return f"{pipeline}-runtime"


def keys_secret_name(pipeline: str) -> str:
    """The Secret holding the pipeline's ZMQ keys (made by the operator, never rendered)."""
    return f"{pipeline}{C.KEYS_SECRET_SUFFIX}"


def network_policy_name(pipeline: str) -> str:
    return pipeline


def egress_policy_name(pipeline: str) -> str:
    return f"{pipeline}-egress"


def stage_name(pipeline: str, stage: str) -> str:
    """Deployment, headless Service, PodDisruptionBudget and HPA of a host stage."""
    return f"{pipeline}-{stage}"


def masters_address(pipeline: str, namespace: str) -> str:
    """A stage's --master: the headless Service's name resolves to every master's pod IP."""
    return f"{masters_name(pipeline)}.{namespace}.svc:{C.MASTER_CONTROL_PORT}"


def master_endpoint(pipeline: str, namespace: str, api_port: int) -> str:
    return f"http://{master_name(pipeline)}.{namespace}.svc:{api_port}"


def data_port_name(index: int) -> str:
    return C.PORT_NAME_DATA if index == 0 else f"{C.PORT_NAME_DATA}-{index}"


def bulk_port_name(index: int) -> str:
    return C.PORT_NAME_BULK if index == 0 else f"{C.PORT_NAME_BULK}-{index}"


def check_names(doc: OmniPipeline) -> list[Problem]:
    """Every generated name must be a DNS-1035 label (Services demand it)."""
    name = doc.metadata.name
    problems = []
    if not _DNS1035.match(name):
        problems.append(Problem(
            "metadata.name",
            f"{name!r} must be a DNS label (lowercase letters, digits and '-', starting with a letter): "
            "it names Services",
        ))
        return problems
    longest = max([MASTER_SUFFIX, MASTERS_SUFFIX, "runtime", "config"], key=len)
    over = len(f"{name}-{longest}") - DNS_LABEL_MAX
    if over > 0:
        problems.append(Problem(
            "metadata.name",
            f"too long by {over}: {name!r} makes {name}-{longest!s} "
            f"({len(name) + 1 + len(longest)} characters, limit {DNS_LABEL_MAX})",
        ))
    for i, stage in enumerate(doc.spec.stages):
        if stage.name in RESERVED_STAGE_NAMES:
            problems.append(Problem(
                f"spec.stages[{i}].name",
                f"{stage.name!r} is reserved (used by {sorted(RESERVED_STAGE_NAMES)} objects)",
            ))
        if stage.is_colocated:
            continue  # runs in its host's pods: no objects of its own
        full = stage_name(name, stage.name)
        if len(full) > DNS_LABEL_MAX:
            problems.append(Problem(
                f"spec.stages[{i}].name",
                f"too long by {len(full) - DNS_LABEL_MAX}: with pipeline {name!r} it makes the Service name "
                f"{full!r} ({len(full)} characters, limit {DNS_LABEL_MAX})",
            ))
    return problems
