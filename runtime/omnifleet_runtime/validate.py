"""Parse and check pipeline documents; every problem names its field path.

`check_spec` repeats, in Python, each CEL rule the CRD carries, and adds what
CEL cannot say (the graph is acyclic, GPU memory shares of co-located stages).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterable

import pydantic

from . import constants as C
from .schema import RESERVED_MOUNT_PATHS, RESERVED_VOLUMES, VOLUME_SOURCES, OmniPipeline, PipelineSpec


@dataclass(frozen=True, order=True)
class Problem:
    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


class InvalidPipeline(ValueError):
    def __init__(self, problems: list[Problem]):
        self.problems = problems
        super().__init__("; ".join(map(str, problems)))


def format_loc(loc: Iterable[Any], root: str = "") -> str:
    path = root
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            path += f".{part}" if path else str(part)
    return path


def _pydantic_problems(err: pydantic.ValidationError, root: str) -> list[Problem]:
    out = []
    for e in err.errors(include_url=False):
        # Unions and custom types add synthetic loc parts like 'function-after[...]'.
        loc = [p for p in e["loc"] if not (isinstance(p, str) and "[" in p)]
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown field"
        out.append(Problem(format_loc(loc, root), msg))
    return sorted(set(out))


def parse_spec(spec: Any, root: str = "spec") -> tuple[PipelineSpec | None, list[Problem]]:
    try:
        parsed = PipelineSpec.model_validate(spec)
    except pydantic.ValidationError as err:
        return None, _pydantic_problems(err, root)
    return parsed, check_spec(parsed, root)


def parse_pipeline(doc: Any) -> tuple[OmniPipeline | None, list[Problem]]:
    """Parse a whole OmniPipeline document; problems instead of exceptions."""
    if not isinstance(doc, dict):
        return None, [Problem("(document)", "expected a mapping with apiVersion, kind, metadata and spec")]
    try:
        parsed = OmniPipeline.model_validate(doc)
    except pydantic.ValidationError as err:
        return None, _pydantic_problems(err, "")
    problems = check_spec(parsed.spec, "spec")
    return (None if problems else parsed), problems


def load_pipeline(doc: Any) -> OmniPipeline:
    parsed, problems = parse_pipeline(doc)
    if problems or parsed is None:
        raise InvalidPipeline(problems)
    return parsed


# Names and values that say "a secret": as a literal they would be stored in
# the ConfigMap and the Deployments, readable by anyone who can read those.
# Whole words of a name only: HF_TOKEN is one, TOKENIZERS_PARALLELISM and vLLM's `tokenizer` are not.
SECRET_NAME = re.compile(
    r"(^|_)(TOKEN|SECRET|PASSWORD|PASSWD|API_?KEY|ACCESS_?KEY|PRIVATE_?KEY|CREDENTIALS?)($|_)", re.I)
SECRET_VALUE = re.compile(
    r"^(hf_[A-Za-z0-9]{20,}|sk-[A-Za-z0-9_-]{20,}|gh[pousr]_[A-Za-z0-9]{20,}|github_pat_\w{20,}|glpat-[\w-]{20,}"
    r"|xox[abposr]-[\w-]{10,}|AKIA[0-9A-Z]{16}|eyJ[\w-]{10,}\.[\w-]{10,}\.[\w-]*)$")
SECRET_POINTER = "use valueFrom.secretKeyRef (a Secret) instead: a literal is stored in the ConfigMap and the pods' specs"


def pod_parts(spec: PipelineSpec, root: str = "spec") -> list[tuple[str, Any]]:
    """(path, part) of the master and each stage: the spec parts that carry env, volumes and pod fields."""
    return [(f"{root}.master", spec.master)] + [(f"{root}.stages[{i}]", s) for i, s in enumerate(spec.stages)]


def secret_literals(spec: PipelineSpec, root: str = "spec") -> list[Problem]:
    """Literal env values and engineArgs that look like tokens, refused with where to put them instead."""
    out: list[Problem] = []
    for at, part in pod_parts(spec, root):
        path = f"{at}.env"
        for j, e in enumerate(part.env):
            if e.value and (SECRET_NAME.search(e.name) or SECRET_VALUE.match(e.value.strip())):
                out.append(Problem(f"{path}[{j}].value", f"{e.name} looks like a secret; {SECRET_POINTER}"))
    for i, s in enumerate(spec.stages):
        for key, value in s.engine_args.items():
            literal = isinstance(value, str) and bool(value)
            if literal and (SECRET_NAME.search(key) or SECRET_VALUE.match(value.strip())):
                out.append(Problem(
                    f"{root}.stages[{i}].engineArgs.{key}",
                    "looks like a secret; engine arguments are stored in the ConfigMap: put it in a Secret and pass "
                    "it as an env variable with valueFrom.secretKeyRef (e.g. HF_TOKEN, which vLLM reads)"))
    return out


def keys_references(spec: PipelineSpec, root: str = "spec") -> list[Problem]:
    """References to Secrets named like a pipeline's ZMQ keys, refused.

    The operator mounts what a pipeline names, so without this an author who
    may not read Secrets could mount another pipeline's keys (and then speak
    for its stages); a pipeline's own keys are mounted by the operator.
    """
    out: list[Problem] = []
    suffix = C.KEYS_SECRET_SUFFIX

    def check(path: str, name: Any) -> None:
        if isinstance(name, str) and name.endswith(suffix):
            out.append(Problem(path, f"Secret {name!r}: names ending in {suffix!r} are reserved for pipelines' "
                                     f"ZMQ keys, which only the operator mounts; rename the Secret"))

    for at, part in pod_parts(spec, root):
        for j, e in enumerate(part.env):
            ref = (e.value_from or {}).get("secretKeyRef") or {}
            check(f"{at}.env[{j}].valueFrom.secretKeyRef.name", ref.get("name"))
        for j, v in enumerate(part.volumes):
            check(f"{at}.volumes[{j}].secret.secretName", (v.secret or {}).get("secretName"))
            for k, src in enumerate((v.projected or {}).get("sources") or []):
                if isinstance(src, dict):
                    check(f"{at}.volumes[{j}].projected.sources[{k}].secret.name", (src.get("secret") or {}).get("name"))
    return out


def check_spec(spec: PipelineSpec, root: str = "spec") -> list[Problem]:
    problems: list[Problem] = []
    add = lambda path, msg: problems.append(Problem(f"{root}.{path}", msg))  # noqa: E731
    index = {}
    for i, s in enumerate(spec.stages):
        if s.name in index:
            add(f"stages[{i}].name", f"duplicate stage name {s.name!r} (also stages[{index[s.name]}])")
        else:
            index[s.name] = i

    for i, s in enumerate(spec.stages):
        at = f"stages[{i}]"
        if s.type in ("python", "torch") and not s.entrypoint:
            add(f"{at}.entrypoint", f"required for {s.type} stages (module:callable)")
        if s.type == "llm" and s.entrypoint:
            add(f"{at}.entrypoint", "not used by llm stages")
        if s.type == "vllm-omni":
            if s.vllm_omni is None:
                add(f"{at}.vllmOmni", "required for vllm-omni stages")
            if s.entrypoint:
                add(f"{at}.entrypoint", "not used by vllm-omni stages")
        elif s.vllm_omni is not None:
            add(f"{at}.vllmOmni", "only for vllm-omni stages")
        if s.loras and s.type != "llm":
            add(f"{at}.loras", "only llm stages serve LoRA adapters")
        seen_loras: dict[str, int] = {}
        for j, lora in enumerate(s.loras):
            if lora.name in seen_loras:
                add(f"{at}.loras[{j}].name", f"duplicate adapter name {lora.name!r} (also loras[{seen_loras[lora.name]}])")
            seen_loras.setdefault(lora.name, j)
            if lora.name == spec.model:
                add(f"{at}.loras[{j}].name", "must differ from spec.model (the base model's name in requests)")
        if s.prompt_expand and s.inputs and s.effective_input_mode() == "stream":
            add(f"{at}.promptExpand", "expands a whole input: set inputMode: whole (or use it on the entry stage)")
        if s.prompt_expand and not any(s.name in o.inputs for o in spec.stages):
            add(f"{at}.promptExpand", "no stage takes this stage's output, so its companions' would go nowhere")
        if s.replicas is not None and s.autoscaling is not None:
            add(f"{at}.autoscaling", "set replicas or autoscaling, not both")
        if s.autoscaling and s.autoscaling.min_replicas > s.autoscaling.max_replicas:
            add(f"{at}.autoscaling.minReplicas", "must not exceed maxReplicas")
        if s.autoscaling and s.autoscaling.min_replicas == 0 and s.colocate_with is None and s.autoscaling.metric_for(
                [s] + [o for o in spec.stages if o.colocate_with == s.name]) != "inflight":
            add(f"{at}.autoscaling.minReplicas", "0 (scale to zero) scales on the masters' demand for the stage: "
                "set metric to inflight")
        if s.autoscaling and s.colocate_with is None and s.autoscaling.metric_stage(
                [s] + [o for o in spec.stages if o.colocate_with == s.name]) is None:
            add(f"{at}.autoscaling.metric", "realTimeFactor needs a stage in this stage's pods (itself or one "
                "co-located with it) whose finalOutput is audio")
        for j, name in enumerate(s.inputs):
            if name == s.name:
                add(f"{at}.inputs[{j}]", "a stage cannot be its own input")
            elif name not in index:
                add(f"{at}.inputs[{j}]", f"no stage named {name!r}")
        if len(set(s.inputs)) != len(s.inputs):
            add(f"{at}.inputs", "lists a stage more than once")
        if s.colocate_with is not None:
            for field in ("gpus", "replicas", "autoscaling"):
                if getattr(s, field) is not None:
                    add(f"{at}.{field}", f"a co-located stage shares its host's {field}; do not set it")
            host = s.colocate_with
            if host == s.name:
                add(f"{at}.colocateWith", "a stage cannot be co-located with itself")
            elif host not in index:
                add(f"{at}.colocateWith", f"no stage named {host!r}")
            elif spec.stages[index[host]].colocate_with is not None:
                add(f"{at}.colocateWith", f"stage {host!r} is itself co-located; name its host instead")
            elif s.image is not None and s.image != (spec.stages[index[host]].image or spec.image):
                add(f"{at}.image", f"a co-located stage runs in the container of {host!r} and uses its image")

    _check_volumes("master", spec.master.volumes, spec.master.volume_mounts, add)
    for i, peer in enumerate(spec.master.admin_sources):
        if peer.pod_selector is None and peer.namespace_selector is None and peer.ip_block is None:
            add(f"master.adminSources[{i}]", "set podSelector, namespaceSelector or ipBlock")
        elif peer.ip_block is not None and (peer.pod_selector is not None or peer.namespace_selector is not None):
            add(f"master.adminSources[{i}].ipBlock", "ipBlock does not combine with selectors")
    limits = spec.master.limits
    if limits.request_timeout_seconds > limits.max_request_timeout_seconds:
        add("master.limits.requestTimeoutSeconds", "must not exceed maxRequestTimeoutSeconds")
    for host in spec.hosts():
        group = [(index[s.name], s) for s in spec.stages if s.name == host.name or s.colocate_with == host.name]
        pod_volumes = [(f"stages[{i}].volumes[{j}]", v) for i, s in group for j, v in enumerate(s.volumes)]
        for i, s in group:
            _check_volumes(f"stages[{i}]", s.volumes, s.volume_mounts, add, pod_volumes)
    problems += secret_literals(spec, root)
    for at, part in pod_parts(spec, root):
        for key in part.pod_annotations:
            if key.split("/")[0].endswith(C.ANNOTATION_DOMAIN):
                problems.append(Problem(f"{at}.podAnnotations",
                                        f"{key!r}: {C.ANNOTATION_DOMAIN}/ annotations are the operator's"))
    problems += keys_references(spec, root)

    if spec.rollout is not None and spec.rollout.max_surge + spec.rollout.max_unavailable == 0:
        add("rollout", "maxSurge and maxUnavailable cannot both be 0: the rollout could never start")
    hb = spec.heartbeat
    if hb is not None and hb.timeout_seconds < 2 * hb.interval_seconds:
        add("heartbeat.timeoutSeconds", f"must be at least twice intervalSeconds ({hb.interval_seconds:g}), "
                                        f"got {hb.timeout_seconds:g}")

    mv = spec.model_volume
    if mv is not None and (mv.claim_name is None) == (mv.host_path is None):
        add("modelVolume", "set exactly one of claimName or hostPath")

    entries = [s.name for s in spec.stages if not s.inputs]
    if len(entries) != 1:
        add("stages", f"exactly one stage must have no inputs (the entry stage); found {len(entries)}: {entries}")
    if not any(s.final_output != "none" for s in spec.stages):
        add("stages", "at least one stage must have a finalOutput")

    cycle = _find_cycle({s.name: [i for i in s.inputs if i in index] for s in spec.stages})
    if cycle:
        add(f"stages[{index[cycle[0]]}].inputs", "the stage graph has a cycle: " + " -> ".join(cycle))

    for host in spec.hosts():
        group = [s for s in spec.stages if s.name == host.name or s.colocate_with == host.name]
        shares = {s.name: s.engine_args.get("gpu_memory_utilization") for s in group}
        stated = {k: v for k, v in shares.items() if v is not None}
        for name, v in stated.items():
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 1:
                add(f"stages[{index[name]}].engineArgs.gpu_memory_utilization", f"must be a number in (0, 1], got {v!r}")
        numeric = {k: v for k, v in stated.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if len(group) > 1 and sum(numeric.values()) > 1.0 + 1e-9:
            parts = " + ".join(f"{k} {v}" for k, v in numeric.items())
            add(
                f"stages[{index[host.name]}].engineArgs.gpu_memory_utilization",
                f"co-located stages share the GPUs of {host.name!r} but ask for {parts} = "
                f"{sum(numeric.values()):.2f} > 1.0",
            )
    return sorted(set(problems))


def _check_volumes(at: str, volumes, mounts, add, pod_volumes=None) -> None:
    """Names unique in the pod and not the operator's own; one source each; mounts name a volume of the pod."""
    pod_volumes = pod_volumes if pod_volumes is not None else [(f"{at}.volumes[{j}]", v) for j, v in enumerate(volumes)]
    seen: dict[str, str] = {}
    for path, v in pod_volumes:
        if v.name in seen and seen[v.name] != path and path.startswith(at + "."):
            add(f"{path}.name", f"duplicate volume name {v.name!r} in the pod (also {seen[v.name]})")
        seen.setdefault(v.name, path)
    for j, v in enumerate(volumes):
        if v.name in RESERVED_VOLUMES:
            add(f"{at}.volumes[{j}].name", f"{v.name!r} is a volume the operator mounts itself "
                f"(reserved: {', '.join(RESERVED_VOLUMES)})")
        sources = [k for k in VOLUME_SOURCES if getattr(v, _snake(k)) is not None]
        if len(sources) != 1:
            add(f"{at}.volumes[{j}]", f"set exactly one volume source ({', '.join(VOLUME_SOURCES)}); "
                f"found {sources or 'none'}")
    paths: dict[str, int] = {}
    for j, m in enumerate(mounts):
        if m.name not in seen:
            add(f"{at}.volumeMounts[{j}].name", f"no volume named {m.name!r} in this pod")
        clean = m.mount_path.rstrip("/") or "/"
        for r in RESERVED_MOUNT_PATHS:
            if clean == r or clean.startswith(r + "/") or r.startswith(clean + "/") or clean == "/":
                add(f"{at}.volumeMounts[{j}].mountPath", f"{m.mount_path!r} overlaps {r}, which the operator mounts")
                break
        if clean in paths:
            add(f"{at}.volumeMounts[{j}].mountPath", f"also mounted by volumeMounts[{paths[clean]}]")
        paths.setdefault(clean, j)


def _snake(camel: str) -> str:
    return {"downwardAPI": "downward_api"}.get(camel) or "".join("_" + c.lower() if c.isupper() else c for c in camel)


def _find_cycle(graph: dict[str, list[str]]) -> list[str] | None:
    """A cycle in `stage -> its inputs` as a list of names ending where it starts."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in graph.get(n, []):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        stack.pop()
        state[n] = 2
        return None

    for n in graph:
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def topological_order(spec: PipelineSpec) -> list[str]:
    """Stage names, each after all of its inputs (ties in spec order)."""
    done: list[str] = []
    remaining = list(spec.stages)
    while remaining:
        ready = [s for s in remaining if all(i in done for i in s.inputs)]
        if not ready:
            raise InvalidPipeline([Problem("spec.stages", "the stage graph has a cycle")])
        done.extend(s.name for s in ready)
        remaining = [s for s in remaining if s.name not in done]
    return done


def resolve(doc: OmniPipeline) -> OmniPipeline:
    """Fill every default so the runtime reads exactly what the operator meant.

    Idempotent: resolving a resolved document changes nothing.
    """
    spec = doc.spec
    hosts = {s.name: s for s in spec.hosts()}
    stages = []
    for s in spec.stages:
        update: dict[str, Any] = {"model": s.model or spec.model, "input_mode": s.effective_input_mode()}
        if s.is_colocated:
            update["image"] = hosts[s.colocate_with].image or spec.image
        else:
            update["image"] = s.image or spec.image
            update["gpus"] = 1 if s.gpus is None else s.gpus
            if s.autoscaling is None and s.replicas is None:
                update["replicas"] = 1
        stages.append(s.model_copy(update=update))
    return doc.model_copy(update={"spec": spec.model_copy(update={"stages": stages})})


def dump(doc: OmniPipeline) -> dict[str, Any]:
    """The wire form (camelCase, no nulls) of a document."""
    out = doc.model_dump(by_alias=True, exclude_none=True, mode="json")
    meta = {"name": doc.metadata.name}
    if doc.metadata.namespace:
        meta["namespace"] = doc.metadata.namespace
    if doc.metadata.generation is not None:
        meta["generation"] = doc.metadata.generation
    out["metadata"] = meta
    return out
