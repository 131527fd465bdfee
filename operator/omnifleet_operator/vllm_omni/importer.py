"""`omnifleet import vllm-omni FILE`: a vLLM-Omni deploy file as an OmniPipeline.

The deploy file is resolved by vLLM-Omni's rules (`deploy.py`) against the
pipeline topology of the same vLLM-Omni version (`pipelines-<version>.yaml`),
then each of its stages becomes a `vllm-omni` stage:

- name: the topology's model stage (`thinker`), as a DNS label;
- worker type, input processor, async-chunk mode and the rest of vLLM-Omni's
  per-stage config: `vllmOmni`;
- GPUs per replica: what vLLM-Omni gives one replica (tensor x data x pipeline
  parallel, or the diffusion parallel world size); replicas: `num_replicas`;
- stages whose device lists share a GPU run in one pod (`colocateWith` the
  stage with the lowest id), with the pod's GPUs the union of their devices
  and each stage's own devices renumbered inside the pod;
- inputs from `input_sources`; `inputMode: stream` on edges vLLM-Omni runs in
  async-chunk mode; the final output type; engine args and default sampling
  params exactly as vLLM-Omni's loader computes them.

What does not map is a warning; what cannot run is a refusal with its reason
(the result then carries no document). Pure: no cluster, no vLLM-Omni.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from omnifleet_runtime.schema import FinalOutput

from ..checks import check_document
from .deploy import Deploy, DeployError, MergedStage, apply_platform, load_deploy, merge
from .topology import data_path

DEFAULT_VERSION = "0.30.0"
PLATFORM = "cuda"  # stage pods request nvidia.com/gpu
# Connectors that move stage payloads over the network; omnifleet moves payloads between pods itself.
LOCAL_CONNECTORS = {"SharedMemoryConnector"}
FINAL_OUTPUTS = set(FinalOutput.__args__)  # type: ignore[attr-defined]
FINAL_ALIASES = {"actions": "action"}


@dataclass
class ImportResult:
    document: dict[str, Any] | None = None
    warnings: list[str] = field(default_factory=list)
    refusals: list[str] = field(default_factory=list)
    pipeline: str | None = None


def load_topologies(version: str = DEFAULT_VERSION) -> dict[str, Any]:
    path = data_path(version)
    if not path.exists():
        have = sorted(p.stem.removeprefix("pipelines-") for p in path.parent.glob("pipelines-*.yaml"))
        raise SystemExit(f"no vLLM-Omni {version} topology data (have: {', '.join(have)})")
    return yaml.safe_load(path.read_text())


def stage_name(model_stage: str) -> str:
    name = re.sub(r"[^a-z0-9-]+", "-", model_stage.lower()).strip("-")
    if not name or not name[0].isalpha():
        name = "s-" + name
    return name[:50].rstrip("-")


def pipeline_name(path: Path) -> str:
    return stage_name(path.stem)[:40].rstrip("-")


def choose_pipeline(path: Path, deploy: Deploy, given: str | None, data: dict[str, Any],
                    warnings: list[str]) -> str | None:
    """vLLM-Omni's choice when it has no model to inspect: an explicit key, else the pipeline whose
    default deploy file this is (or one of its base_config ancestors), else the longest registry
    key the file name starts with (a guess, said as a warning)."""
    pipelines = data["pipelines"]
    if given:
        return given
    if deploy.pipeline:
        return deploy.pipeline
    for p in deploy.chain:
        owners = sorted(k for k, v in pipelines.items() if v.get("default_deploy_config_name") == p.name)
        if owners:
            return owners[0]
    stem = path.stem
    guesses = sorted((k for k in pipelines if stem == k or stem.startswith(k + "_")), key=len, reverse=True)
    if guesses:
        warnings.append(f"pipeline: the file names none; {guesses[0]!r} chosen from the file name "
                        f"(vLLM-Omni picks it from the model's config; pass --pipeline to choose)")
        return guesses[0]
    return None


def devices_per_replica(stage: MergedStage) -> int:
    """vLLM-Omni's `get_stage_devices_per_replica`."""
    ea = stage.engine_args
    if stage.stage_type == "diffusion":
        pc = dict(ea.get("parallel_config") or {})
        if pc.get("world_size"):
            return max(1, int(pc["world_size"]))
        get = lambda k, d=1: int(pc.get(k) or d)  # noqa: E731
        sp = pc.get("sequence_parallel_size") or (
            get("allgather_degree") if get("allgather_degree") > 1 else get("ulysses_degree") * get("ring_degree"))
        other = get("pipeline_parallel_size") * get("data_parallel_size") * get("tensor_parallel_size") \
            * int(sp) * get("cfg_parallel_size")
        if pc.get("use_hsdp") and other == 1:
            return max(1, get("hsdp_replicate_size") * max(1, int(pc.get("hsdp_shard_size") or 1)))
        return max(1, other)
    tp = int(ea.get("tensor_parallel_size") or 1)
    pp = int(ea.get("pipeline_parallel_size") or 1)
    dp = ea.get("data_parallel_size_local", ea.get("data_parallel_size", 1))
    return tp * max(1, int(dp if dp is not None else 1)) * pp


def replica_devices(stage: MergedStage, per_replica: int, replicas: int) -> list[int]:
    """Replica 0's device ids (vLLM-Omni's `split_devices_for_replicas`); raises ValueError like it."""
    devices = stage.runtime.get("devices")
    if devices is None:  # no placement: the first visible devices
        return list(range(per_replica))
    try:
        ids = [int(d) for d in str(devices).split(",") if d.strip()]
    except ValueError:
        raise ValueError(f"devices={devices!r} is not a list of device indices") from None
    if replicas <= 1:
        return ids
    if len(ids) == replicas * per_replica:
        return ids[:per_replica]
    if len(ids) == per_replica:
        return ids
    raise ValueError(f"devices={devices!r} has {len(ids)} id(s); vLLM-Omni needs {per_replica} (per-replica "
                     f"template) or {replicas * per_replica} (pool) for {replicas} replicas")


def _loopback_values(obj: Any, path: str = "") -> list[tuple[str, str]]:
    out = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _loopback_values(v, f"{path}.{k}" if path else str(k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += _loopback_values(v, f"{path}[{i}]")
    elif isinstance(obj, str):
        host = obj.split("://")[-1].rsplit(":", 1)[0] if "://" in obj else obj
        if host == "localhost":
            out.append((path, obj))
        else:
            try:
                if ipaddress.ip_address(host.strip("[]")).is_loopback:
                    out.append((path, obj))
            except ValueError:
                pass
    return out


def _json(value: Any) -> Any:
    """Tuples as lists, keys as strings: what YAML and the CRD carry."""
    if isinstance(value, dict):
        return {str(k): _json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json(v) for v in value]
    return value


def import_deploy(path: str | Path, pipeline: str | None = None, name: str | None = None,
                  model: str | None = None, version: str = DEFAULT_VERSION,
                  async_chunk: bool | None = None) -> ImportResult:
    """`async_chunk` overrides the file's top-level `async_chunk:` as vLLM-Omni's `--[no-]async-chunk` does
    (None: the file's value)."""
    path = Path(path)
    result = ImportResult()
    warn, refuse = result.warnings.append, result.refusals.append
    data = load_topologies(version)
    try:
        deploy = load_deploy(path, data["deploySchema"])
    except DeployError as e:
        refuse(str(e))
        return result
    if not deploy.stages and not deploy.pipeline and pipeline is None:
        extra = sorted(k for k in deploy.raw if k not in ("stages", "platforms", "connectors"))
        refuse(f"{path.name} has no stages and names no pipeline: not a pipeline deploy file"
               + (f" (it sets {', '.join(extra)})" if extra else ""))
        return result
    key = choose_pipeline(path, deploy, pipeline, data, result.warnings)
    if key is None:
        refuse(f"no pipeline topology: the file names none and is no pipeline's default deploy file; pass "
               f"--pipeline NAME (one of {', '.join(sorted(data['pipelines']))})")
        return result
    topo = data["pipelines"].get(key)
    if topo is None:
        refuse(f"pipeline {key!r} is not registered in vLLM-Omni {data['vllmOmniVersion']} "
               f"(available: {', '.join(sorted(data['pipelines']))})")
        return result
    result.pipeline = key
    if async_chunk is not None:  # where vLLM-Omni applies its CLI override: before the platform overlay
        deploy.async_chunk = async_chunk
    if topo.get("resolver"):
        r = topo["resolver"]
        warn(f"pipeline {key!r}: vLLM-Omni picks one of {', '.join(r['returns'])} from the model's config "
             f"({r['function']}); imported its default, {r['default']}")
    for other in apply_platform(deploy, PLATFORM, data["deploySchema"]):
        warn(f"platforms.{other}: overrides for another platform than {PLATFORM} (NVIDIA GPUs) are not applied")
    try:
        stages = merge(topo, deploy, data)
    except DeployError as e:
        refuse(str(e))
        return result

    known = {s.stage_id for s in stages}
    for ds in deploy.stages:
        if ds.stage_id not in known:
            warn(f"stages: stage_id {ds.stage_id} is not a stage of pipeline {key!r}; vLLM-Omni ignores it, so does this")
    for k in sorted(deploy.raw):
        if k in ("forced_aligner",):
            warn(f"{k}: vLLM-Omni reads it only with --forced-aligner-config; not imported")
        elif k == "edges":
            warn("edges: connector edges are vLLM-Omni's transport wiring; omnifleet routes stage outputs itself")
    if deploy.session_mode == "duplex":
        refuse("session_mode: duplex needs vLLM-Omni's realtime duplex sessions; omnifleet's master serves "
               "turn-based requests only")
    if deploy.model_runner == "v2":
        warn("model_runner: v2 is passed to the stage engines as use_v2_model_runner")

    names: dict[int, str] = {}
    for s in stages:
        n = stage_name(s.model_stage)
        if n in names.values():
            n = stage_name(f"{s.model_stage}-{s.stage_id}")
        names[s.stage_id] = n

    # Placement: per stage, GPUs per replica, replicas and replica 0's devices.
    per, reps, devs = {}, {}, {}
    for s in stages:
        per[s.stage_id] = devices_per_replica(s)
        reps[s.stage_id] = int(s.runtime.get("num_replicas", 1))
        try:
            devs[s.stage_id] = replica_devices(s, per[s.stage_id], reps[s.stage_id])
        except ValueError as e:
            refuse(f"stage {names[s.stage_id]} (stage_id {s.stage_id}): {e}")
            devs[s.stage_id] = list(range(per[s.stage_id]))
        if s.runtime.get("devices") is None and len(stages) > 1:
            warn(f"stage {names[s.stage_id]}: no devices; vLLM-Omni places it on the first visible GPU(s), "
                 f"so it shares them with the other stages that do the same")

    # Co-location: stages whose devices overlap share pods (union-find over the device sets).
    parent = {s.stage_id: s.stage_id for s in stages}

    def root(i: int) -> int:
        while parent[i] != i:
            i = parent[i]
        return i

    ids = [s.stage_id for s in stages]
    for a in ids:
        for b in ids:
            if a < b and set(devs[a]) & set(devs[b]):
                ra, rb = root(a), root(b)
                parent[max(ra, rb)] = min(ra, rb)
    groups: dict[int, list[int]] = {}
    for i in ids:
        groups.setdefault(root(i), []).append(i)
    for host, members in groups.items():
        counts = {names[m]: reps[m] for m in members}
        if len(set(counts.values())) > 1:
            refuse(f"stages {', '.join(counts)} share a GPU ({_shared(devs, members)}) but ask for "
                   + ", ".join(f"{v} replica(s) of {k}" for k, v in counts.items())
                   + "; stages on one GPU run in one pod and share its replica count")

    # GPU memory: the stated shares of every stage on a device add up to at most 1.0.
    usage: dict[int, list[tuple[str, float]]] = {}
    for s in stages:
        share = s.engine_args.get("gpu_memory_utilization")
        if isinstance(share, (int, float)) and not isinstance(share, bool):
            for d in devs[s.stage_id]:
                usage.setdefault(d, []).append((names[s.stage_id], float(share)))
    for d, parts in sorted(usage.items()):
        total = sum(v for _, v in parts)
        if total > 1.0 + 1e-9:
            refuse(f"GPU {d}: gpu_memory_utilization of " + " + ".join(f"{n} {v:g}" for n, v in parts)
                   + f" = {total:.2f} > 1.0")

    # Connectors: shared memory maps onto omnifleet's data path; network ones do not map.
    for cname, spec in sorted((deploy.connectors or {}).items()):
        kind = (spec or {}).get("name") if isinstance(spec, dict) else None
        if kind not in LOCAL_CONNECTORS:
            warn(f"connectors.{cname}: {kind or 'an unnamed connector'} is a network transport between stages; "
                 f"omnifleet carries stage payloads on its own wire, its settings stay in the stage config")
    pods = len(groups)
    for s in stages:
        if s.engine_args.get("kv_transfer_config"):
            kv = s.engine_args["kv_transfer_config"]
            warn(f"stage {names[s.stage_id]}: kv_transfer_config ({kv.get('kv_connector', '?')}) is a network KV "
                 f"connector; passed to the engine as it is, omnifleet does not declare its ports")
        # BAGEL's route: its thinker's KV caches (and its CFG companions') go to the DiT through vLLM-Omni's
        # own connector, not as stage outputs.
        kv_keys = [f"omni_kv_config.{k}" for k in ("need_send_cache", "need_recv_cache")
                   if (s.engine_args.get("omni_kv_config") or {}).get(k)]
        kv_keys += ["cfg_kv_collect_func"] * bool(s.extras.get("cfg_kv_collect_func"))
        if kv_keys:
            warn(f"stage {names[s.stage_id]}: {', '.join(kv_keys)}: vLLM-Omni hands KV caches from one stage's "
                 f"engine to another's; omnifleet's wire does not carry them and runs no such pipeline here "
                 f"(passed to the engines as they are)")
        if pods > 1:
            for where, value in _loopback_values({"engine_args": s.engine_args, "extras": s.extras}):
                refuse(f"stage {names[s.stage_id]}: {where} = {value!r} assumes its peer stages on the same host, "
                       f"but the pipeline runs in {pods} pod groups")
    for cname, spec in sorted((deploy.connectors or {}).items()):
        if pods > 1:
            for where, value in _loopback_values(spec):
                refuse(f"connectors.{cname}.{where} = {value!r} assumes the stages on one host, "
                       f"but the pipeline runs in {pods} pod groups")

    # Topology checks omnifleet needs.
    entries = [names[s.stage_id] for s in stages if not s.input_sources]
    if len(entries) != 1:
        refuse(f"omnifleet pipelines have one entry stage; this one has {len(entries)}: {', '.join(entries)}")
    omni_stages = []
    for s in stages:
        final = "none"
        if s.final_output:
            t = FINAL_ALIASES.get(s.final_output_type or "", s.final_output_type)
            if t in FINAL_OUTPUTS:
                final = t
            else:
                refuse(f"stage {names[s.stage_id]}: final output type {s.final_output_type!r} has no omnifleet "
                       f"equivalent ({', '.join(sorted(FINAL_OUTPUTS - {'none'}))})")
        omni_stages.append(_stage(s, key, names, final, reps, devs, groups, root, deploy, result.warnings))
    if result.refusals:
        return result

    spec: dict[str, Any] = {"stages": omni_stages}
    if model:
        spec["model"] = model
    else:
        warn("spec.model: not set (a deploy file names no model); set it, or each stage's model, before applying")
    doc = {
        "apiVersion": "omnifleet.dev/v1alpha1",
        "kind": "OmniPipeline",
        "metadata": {
            "name": name or pipeline_name(path),
            "annotations": {"omnifleet.dev/imported-from": f"vllm-omni {data['vllmOmniVersion']} {path.name} "
                                                           f"(pipeline {key})"},
        },
        "spec": spec,
    }
    parsed, problems = check_document(doc)
    for p in problems:
        refuse(f"the converted pipeline does not validate: {p}")
    if not problems:
        result.document = doc
    return result


def _shared(devs: dict[int, list[int]], members: list[int]) -> str:
    seen: dict[int, int] = {}
    for m in members:
        for d in devs[m]:
            seen[d] = seen.get(d, 0) + 1
    return "GPU " + ",".join(str(d) for d, c in sorted(seen.items()) if c > 1)


def _stage(s: MergedStage, key: str, names, final, reps, devs, groups, root, deploy: Deploy,
           warnings) -> dict[str, Any]:
    sid = s.stage_id
    host = root(sid)
    pod_devices = sorted({d for m in groups[host] for d in devs[m]})
    out: dict[str, Any] = {"name": names[sid], "type": "vllm-omni"}
    if s.input_sources:
        out["inputs"] = [names[i] for i in s.input_sources]
        if s.engine_args.get("async_chunk"):
            out["inputMode"] = "stream"
        else:
            out["inputMode"] = "whole"
    if final != "none":
        out["finalOutput"] = final
    if host == sid:
        out["gpus"] = len(pod_devices)
        out["replicas"] = reps[sid]
    else:
        out["colocateWith"] = names[host]
    omni: dict[str, Any] = {
        "pipeline": key,
        "stageId": sid,
        "modelStage": s.model_stage,
        "workerType": s.worker_type or "diffusion",
    }
    if s.custom_process_input_func:
        omni["inputProcessor"] = s.custom_process_input_func
    if s.engine_args.get("async_chunk"):
        omni["asyncChunk"] = True
    local = [pod_devices.index(d) for d in devs[sid]]
    if len(groups[host]) > 1 or local != list(range(len(pod_devices))):
        omni["devices"] = ",".join(map(str, local))
    stage_config = {
        "stageType": s.stage_type,
        "schedulerCls": s.scheduler_cls,
        "hfConfigName": s.hf_config_name,
        "isComprehension": s.is_comprehension,
        "finalOutput": s.final_output,
        "finalOutputType": s.final_output_type,
        "samplingConstraints": _json(s.sampling_constraints),
        "requiresMultimodalData": bool(s.runtime.get("requires_multimodal_data")),
        "sessionMode": deploy.session_mode,
        "extras": _json({k: v for k, v in s.extras.items() if k != "default_sampling_params"}),
    }
    connectors = {}
    for side in ("input_connectors", "output_connectors"):
        for edge, cname in (s.extras.get(side) or {}).items():
            if cname in (deploy.connectors or {}):
                connectors[cname] = deploy.connectors[cname]
    if connectors:
        stage_config["connectors"] = _json(connectors)
    omni["stageConfig"] = {k: v for k, v in stage_config.items() if v not in (None, {}, [])}
    out["vllmOmni"] = omni
    out["engineArgs"] = _json({k: v for k, v in s.engine_args.items() if v is not None})
    sampling = s.extras.get("default_sampling_params")
    if sampling:
        out["samplingParams"] = _json(sampling)
    env = s.runtime.get("env")
    if isinstance(env, dict) and env:
        out["env"] = [{"name": str(k), "value": "" if v is None else str(v)} for k, v in env.items()]
    elif env:
        warnings.append(f"stage {names[sid]}: env is not a mapping ({type(env).__name__}); not imported")
    return out

