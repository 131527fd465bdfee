"""vLLM-Omni deploy files resolved by vLLM-Omni's own rules, without vLLM-Omni.

A port of the loader in vLLM-Omni's `vllm_omni/config/stage_config.py`
(`resolve_deploy_yaml`, `load_deploy_config`, `_apply_platform_overrides`,
`merge_pipeline_deploy`): files are read with omegaconf as vLLM-Omni reads
them, `base_config` chains are merged (stages by `stage_id`, deep-merged
sampling and engine dicts, per-platform sections), the platform's overlay is
applied, and each stage of the pipeline topology gets the engine args,
runtime placement and extras vLLM-Omni would hand to its stage engine. The
field lists come from the topology data file of the same vLLM-Omni version.
Errors vLLM-Omni raises become `DeployError` with the same reason.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException


class DeployError(ValueError):
    """vLLM-Omni would refuse this deploy file; the message says why."""


@dataclass
class StageDeploy:
    stage_id: int
    devices: str | None = None
    num_replicas: int = 1
    env: dict[str, Any] | None = None
    async_chunk: bool | None = None
    output_connectors: dict[str, str] | None = None
    input_connectors: dict[str, str] | None = None
    default_sampling_params: dict[str, Any] | None = None
    default_pooling_params: dict[str, Any] | None = None
    fields: dict[str, Any] = field(default_factory=dict)  # StageDeployConfig's other fields that were set
    engine_extras: dict[str, Any] = field(default_factory=dict)


@dataclass
class Deploy:
    raw: dict[str, Any]  # the merged file (base_config chain resolved), before platform overlays
    chain: list[Path]  # the file, then its base_config ancestors
    stages: list[StageDeploy]
    async_chunk: bool = True
    session_mode: str = "turn"
    model_runner: str = "v1"
    active_stream_window: int = 0
    pipeline: str | None = None
    connectors: dict[str, Any] | None = None
    platforms: dict[str, Any] | None = None
    wide: dict[str, Any] = field(default_factory=dict)  # pipeline-wide engine settings that were set


@dataclass
class MergedStage:
    """One stage as vLLM-Omni's `merge_pipeline_deploy` leaves it (its legacy StageConfig)."""

    stage_id: int
    model_stage: str
    stage_type: str  # llm | diffusion
    worker_type: str | None  # ar | generation | None (diffusion)
    input_sources: list[int]
    custom_process_input_func: str | None
    final_output: bool
    final_output_type: str | None
    scheduler_cls: str | None
    hf_config_name: str | None
    is_comprehension: bool
    sampling_constraints: dict[str, Any]
    engine_args: dict[str, Any]
    runtime: dict[str, Any]
    extras: dict[str, Any]
    deploy: StageDeploy | None


def _load_yaml(path: Path) -> dict[str, Any]:
    try:
        data = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    except FileNotFoundError:
        raise DeployError(f"{path}: no such file") from None
    except (OmegaConfBaseException, ValueError, OSError) as e:  # yaml errors surface as ValueError subclasses
        raise DeployError(f"{path}: cannot read it as YAML: {e}") from None
    except Exception as e:  # omegaconf raises yaml's own errors for malformed YAML
        raise DeployError(f"{path}: cannot read it as YAML: {type(e).__name__}: {e}") from None
    if not isinstance(data, dict):
        raise DeployError(f"{path}: a deploy file is a mapping, not a {type(data).__name__}")
    return data


def merged_dict(original: dict, update: dict) -> dict:
    """vLLM-Omni's `_get_recursively_merged_dict`."""
    merged = dict(original)
    for k, v in update.items():
        if isinstance(merged.get(k), dict) and isinstance(v, dict):
            merged[k] = merged_dict(merged[k], v)
        else:
            merged[k] = v
    return merged


def _deep_merge_stage(base: dict, overlay: dict, deep_keys: frozenset[str]) -> dict:
    sub = merged_dict({k: v for k, v in base.items() if k in deep_keys},
                      {k: v for k, v in overlay.items() if k in deep_keys})
    return {**base, **overlay, **sub}


def _merge_stage_lists(base: list | None, overlay: list | None, deep_keys: frozenset[str]) -> list[dict]:
    by_id: dict[int, dict] = {}
    for s in base or []:
        by_id[_stage_id(s)] = s
    for s in overlay or []:
        sid = _stage_id(s)
        by_id[sid] = _deep_merge_stage(by_id[sid], s, deep_keys) if sid in by_id else s
    return list(by_id.values())


def _stage_id(stage: Any) -> int:
    if not isinstance(stage, dict) or "stage_id" not in stage:
        raise DeployError(f"every entry of stages: needs a stage_id (got {stage!r:.80})")
    if isinstance(stage["stage_id"], bool) or not isinstance(stage["stage_id"], int):
        raise DeployError(f"stage_id must be an integer (got {stage['stage_id']!r})")
    return stage["stage_id"]


def resolve_deploy_yaml(path: Path, deep_keys: frozenset[str], _seen: tuple[Path, ...] = ()) -> tuple[dict, list[Path]]:
    """The file with its base_config chain merged (vLLM-Omni's `resolve_deploy_yaml`), and the chain."""
    path = Path(path)
    if path.resolve() in _seen:
        raise DeployError(f"{path}: base_config chain loops: " + " -> ".join(p.name for p in (*_seen, path)))
    raw = _load_yaml(path)
    base_name = raw.pop("base_config", None)
    if base_name is None:
        return raw, [path]
    base_path = path.parent / str(base_name)  # relative to the overlay's directory, as vLLM-Omni resolves it
    if not base_path.exists():
        raise DeployError(f"{path}: base_config {base_name} not found (looked for {base_path})")
    base, chain = resolve_deploy_yaml(base_path, deep_keys, (*_seen, path.resolve()))
    merged = {**base, **{k: v for k, v in raw.items() if k not in ("connectors", "stages", "platforms")}}
    if base.get("connectors") or raw.get("connectors"):
        merged["connectors"] = merged_dict(base.get("connectors") or {}, raw.get("connectors") or {})
    merged["stages"] = _merge_stage_lists(base.get("stages"), raw.get("stages"), deep_keys)
    if base.get("platforms") or raw.get("platforms"):
        bp_all, op_all = base.get("platforms") or {}, raw.get("platforms") or {}
        platforms = {}
        for plat in set(bp_all) | set(op_all):
            bp, op = bp_all.get(plat) or {}, op_all.get(plat) or {}
            merged_plat = {**bp, **{k: v for k, v in op.items() if k != "stages"}}
            merged_plat["stages"] = _merge_stage_lists(bp.get("stages"), op.get("stages"), deep_keys)
            platforms[plat] = merged_plat
        merged["platforms"] = platforms
    return merged, [path, *chain]


def load_deploy(path: Path, schema: dict[str, Any]) -> Deploy:
    """vLLM-Omni's `load_deploy_config`."""
    deep_keys = frozenset(schema["deepMergeKeys"])
    raw, chain = resolve_deploy_yaml(path, deep_keys)
    if "stage_args" in raw:
        raise DeployError(f"{path} uses the removed `stage_args` schema; vLLM-Omni defines topology in "
                          f"PipelineConfig and deployment overrides under `stages`")
    stages_raw = raw.get("stages") or []
    if not isinstance(stages_raw, list):
        raise DeployError(f"stages: must be a list (got {type(stages_raw).__name__})")
    stages = [_parse_stage(s, schema) for s in stages_raw]
    model_runner = raw.get("model_runner", "v1")
    if model_runner not in ("v1", "v2"):
        raise DeployError(f"model_runner must be one of ('v1', 'v2'), got {model_runner!r}")
    wide = {k: raw[k] for k in schema["pipelineWideEngineFields"] if k in raw and k != "active_stream_window"}
    return Deploy(
        raw=raw, chain=chain, stages=stages, async_chunk=bool(raw.get("async_chunk", True)),
        session_mode=raw.get("session_mode", "turn"), model_runner=model_runner,
        active_stream_window=int(raw.get("active_stream_window", 0) or 0), pipeline=raw.get("pipeline"),
        connectors=raw.get("connectors"), platforms=raw.get("platforms"), wide=wide,
    )


def _parse_stage(data: dict[str, Any], schema: dict[str, Any]) -> StageDeploy:
    """vLLM-Omni's `_parse_stage_deploy`: flat keys and `engine_args:` become fields or engine extras."""
    sid = _stage_id(data)
    reserved = set(schema["stageReservedKeys"])
    known = [f for f in schema["stageFields"] if f not in reserved]
    flat = {k: v for k, v in data.items() if k not in reserved}
    runtime = dict(data.get("runtime") or {})
    for k, v in (data.get("engine_args") or {}).items():
        flat[k] = merged_dict(flat[k], v) if isinstance(v, dict) and isinstance(flat.get(k), dict) else v
    fields = {name: flat.pop(name) for name in known if name in flat}
    try:
        replicas = int(runtime.get("num_replicas", data.get("num_replicas", 1)))
    except (TypeError, ValueError):
        raise DeployError(f"stage {sid}: num_replicas must be an integer") from None
    return StageDeploy(
        stage_id=sid,
        devices=_devices_str(runtime.get("devices", data.get("devices")), sid),
        num_replicas=replicas,
        env=runtime.get("env", data.get("env")),
        async_chunk=data.get("async_chunk"),
        output_connectors=data.get("output_connectors"),
        input_connectors=data.get("input_connectors"),
        default_sampling_params=data.get("default_sampling_params"),
        default_pooling_params=data.get("default_pooling_params"),
        fields=fields,
        engine_extras=merged_dict(dict(data.get("engine_extras") or {}), flat),
    )


def _devices_str(value: Any, sid: int) -> str | None:
    if value is None:
        return None
    if isinstance(value, bool):
        raise DeployError(f"stage {sid}: devices must be a string like \"0,1\" (got {value!r})")
    return str(value)  # YAML reads `devices: 0` as an int


def apply_platform(deploy: Deploy, platform: str, schema: dict[str, Any]) -> list[str]:
    """vLLM-Omni's `_apply_platform_overrides` for one platform; returns the other platforms' names."""
    sections = deploy.platforms or {}
    others = sorted(p for p, v in sections.items() if p != platform and v)
    section = sections.get(platform)
    if section and "model_runner" in section:
        if section["model_runner"] not in ("v1", "v2"):
            raise DeployError(f"platform model_runner must be one of ('v1', 'v2'), got {section['model_runner']!r}")
        deploy.model_runner = section["model_runner"]
    if not section:
        return others
    by_id = {s.stage_id: s for s in deploy.stages}
    for ps in section.get("stages") or []:
        base = by_id.get(_stage_id(ps))
        if base is None:
            continue
        if "engine_args" in ps:
            overrides = dict(ps["engine_args"])
            rt = ps.get("runtime") or {}
            if "num_replicas" in rt:
                overrides["num_replicas"] = rt["num_replicas"]
            devices, env = rt.get("devices"), rt.get("env")
        else:
            overrides = {k: v for k, v in ps.items() if k not in ("stage_id", "devices", "env")}
            devices, env = ps.get("devices"), ps.get("env")
        if devices is not None:
            base.devices = _devices_str(devices, base.stage_id)
        if env is not None:
            base.env = {**base.env, **env} if isinstance(base.env, dict) and isinstance(env, dict) else env
        for key, val in overrides.items():
            _set_stage_field(base, key, val, frozenset(schema["stageFields"]))
    return others


_ATTRS = ("devices", "num_replicas", "env", "async_chunk", "output_connectors", "input_connectors",
          "default_sampling_params", "default_pooling_params")
_DEEP = ("default_sampling_params", "default_pooling_params", "subtalker_sampling_params", "engine_extras")


def _set_stage_field(stage: StageDeploy, key: str, val: Any, known: frozenset[str]) -> None:
    """`setattr(base, key, val)` on vLLM-Omni's dataclass: a known field, else an engine extra."""
    current = getattr(stage, key) if key in _ATTRS else stage.fields.get(key)
    if key in _DEEP and isinstance(val, dict) and isinstance(current, dict):
        val = {**current, **val}
    if key in _ATTRS:
        setattr(stage, key, int(val) if key == "num_replicas" else val)
    elif key == "engine_extras" and isinstance(val, dict):
        stage.engine_extras = {**stage.engine_extras, **val}
    elif key in known:
        stage.fields[key] = val
    else:
        stage.engine_extras[key] = val


def _resolve_async_chunk(deploy: Deploy, stage: StageDeploy | None) -> bool:
    return bool(deploy.async_chunk and (stage is None or stage.async_chunk is not False))


def merge(pipeline: dict[str, Any], deploy: Deploy, data: dict[str, Any]) -> list[MergedStage]:
    """vLLM-Omni's `merge_pipeline_deploy` (platform overlay already applied)."""
    schema = data["deploySchema"]
    reserved = set(schema["stageReservedKeys"])
    stages_topo = sorted(pipeline["stages"], key=lambda s: s["stage_id"])
    by_id = {s.stage_id: s for s in deploy.stages}
    if len(stages_topo) <= 1:
        deploy.async_chunk = False
    has_edges = any(ps.get("input_sources") for ps in stages_topo)
    if deploy.async_chunk and has_edges and not any(
            ps.get("async_chunk_process_next_stage_input_func") for ps in stages_topo):
        raise DeployError(
            f"pipeline {pipeline['model_type']!r} has async_chunk=True in deploy but no stage declares an "
            f"async-chunk next-stage processor; vLLM-Omni refuses it (set async_chunk: false)")
    topo = {ps["stage_id"]: ps for ps in stages_topo}
    for consumer in stages_topo:
        for src in consumer.get("input_sources") or []:
            if src not in topo:
                raise DeployError(f"stage {consumer['stage_id']} reads from stage {src}, which the topology lacks")
            if not topo[src].get("async_chunk_process_next_stage_input_func"):
                continue
            if _resolve_async_chunk(deploy, by_id.get(src)) != _resolve_async_chunk(deploy, by_id.get(consumer["stage_id"])):
                raise DeployError(
                    f"pipeline {pipeline['model_type']!r} has incompatible async_chunk settings on connector edge "
                    f"{src} -> {consumer['stage_id']}; vLLM-Omni needs the same mode on both stages")
    schedulers = data["schedulers"]
    out = []
    for ps in stages_topo:
        ds = by_id.get(ps["stage_id"])
        execution = ps.get("execution_type", "llm_ar")
        stage_type, worker_type = {"llm_ar": ("llm", "ar"), "llm_generation": ("llm", "generation"),
                                   "diffusion": ("diffusion", None)}.get(execution, ("llm", None))
        async_chunk = _resolve_async_chunk(deploy, ds)
        next_proc = ps.get("custom_process_next_stage_input_func")
        input_proc = ps.get("custom_process_input_func")
        if async_chunk and ps.get("async_chunk_process_next_stage_input_func"):
            next_proc = ps["async_chunk_process_next_stage_input_func"]
        elif not async_chunk and ps.get("sync_process_input_func"):
            input_proc = ps["sync_process_input_func"]
        engine_args = _engine_args(ps, ds, pipeline, deploy, next_proc, async_chunk, reserved, schema)
        if not ps.get("requires_multimodal_data"):
            engine_args.setdefault("skip_mm_profiling", True)
        scheduler = None
        if execution == "llm_ar":
            async_sched = engine_args.get("async_scheduling", True)
            scheduler = schedulers["OmniARAsyncScheduler" if async_sched else "OmniARScheduler"]
            engine_args["async_scheduling"] = bool(async_sched)
        elif execution == "llm_generation":
            scheduler = schedulers["OmniGenerationScheduler"]
        extras = _extras(ps, ds)
        runtime: dict[str, Any] = {"process": True}
        if ds is not None:
            if ds.devices is not None:
                runtime["devices"] = ds.devices
            runtime["num_replicas"] = ds.num_replicas
            if ds.env is not None:
                runtime["env"] = ds.env
        runtime["requires_multimodal_data"] = bool(ps.get("requires_multimodal_data"))
        out.append(MergedStage(
            stage_id=ps["stage_id"], model_stage=ps["model_stage"], stage_type=stage_type, worker_type=worker_type,
            input_sources=list(ps.get("input_sources") or []), custom_process_input_func=input_proc,
            final_output=bool(ps.get("final_output")), final_output_type=ps.get("final_output_type"),
            scheduler_cls=ps.get("scheduler_cls") or scheduler, hf_config_name=ps.get("hf_config_name"),
            is_comprehension=bool(ps.get("owns_tokenizer")),
            sampling_constraints=dict(ps.get("sampling_constraints") or {}),
            engine_args=engine_args, runtime=runtime, extras=extras, deploy=ds,
        ))
    return out


def _engine_args(ps, ds, pipeline, deploy, next_proc, async_chunk, reserved, schema) -> dict[str, Any]:
    """vLLM-Omni's `_build_engine_args`."""
    args: dict[str, Any] = {"model_arch": ps.get("model_arch") or pipeline.get("model_arch") or None}
    args["retains_state_across_chunks"] = bool(ps.get("retains_state_across_chunks"))
    if ps.get("execution_type") == "diffusion" and ps.get("model_arch"):
        args.setdefault("model_class_name", ps["model_arch"])
    for key in ("engine_output_type",):
        if ps.get(key):
            args[key] = ps[key]
    if next_proc:
        args["custom_process_next_stage_input_func"] = next_proc
    for key in ("model_subdir", "tokenizer_subdir", "model_path_resolver"):
        if ps.get(key):
            args[key] = ps[key]
    args["inline_diffusion"] = bool(ps.get("inline_diffusion"))
    for key in ("stage_input_payload_keys", "stage_output_payload_keys"):
        if ps.get(key):
            args[key] = list(ps[key])
    for name in schema["pipelineWideEngineFields"]:
        value = deploy.active_stream_window if name == "active_stream_window" else deploy.wide.get(name)
        if value is not None:
            args[name] = value
    if ds is not None:
        for k, v in {**schema["stageFieldDefaults"], **ds.fields}.items():
            if k not in reserved and v is not None:
                args[k] = v
        args.update(ds.engine_extras)
        for key in ("use_v2_model_runner", "supports_native_mrv2_data_plane"):
            if key in ds.engine_extras:
                raise DeployError(f"stage {ds.stage_id}: {key!r} must not be set via engine_extras; vLLM-Omni "
                                  f"derives it from model_runner")
    args["async_chunk"] = async_chunk
    args["session_mode"] = deploy.session_mode
    if deploy.session_mode == "duplex":
        args["duplex_max_sessions"] = (deploy.raw.get("duplex_session") or {}).get("max_sessions", 1)
    args["use_v2_model_runner"] = deploy.model_runner == "v2"
    args["supports_native_mrv2_data_plane"] = bool(ps.get("supports_native_mrv2_data_plane"))
    if ps.get("omni_kv_config"):
        args["omni_kv_config"] = dict(ps["omni_kv_config"])
    args["requires_full_payload_input"] = bool(ps.get("requires_full_payload_input"))
    return args


def _extras(ps: dict[str, Any], ds: StageDeploy | None) -> dict[str, Any]:
    """vLLM-Omni's `_build_extras`: sampling defaults (with the topology's constraints), connectors, hooks."""
    extras: dict[str, Any] = {}
    sampling = dict((ds.default_sampling_params if ds else None) or {})
    constraints = dict(ps.get("sampling_constraints") or {})
    if "stop_token_ids" in constraints:
        constraints["stop_token_ids"] = list(dict.fromkeys(
            [*(sampling.get("stop_token_ids") or []), *(constraints["stop_token_ids"] or [])]))
    sampling = {**sampling, **constraints}
    if sampling:
        extras["default_sampling_params"] = sampling
    if ds is not None and ds.default_pooling_params:
        extras["default_pooling_params"] = dict(ds.default_pooling_params)
    if ds is not None and ds.output_connectors:
        extras["output_connectors"] = dict(ds.output_connectors)
    if ds is not None and ds.input_connectors:
        extras["input_connectors"] = dict(ds.input_connectors)
    for key in ("prompt_transform_func", "prompt_expand_func", "cfg_kv_collect_func"):
        if ps.get(key):
            extras[key] = ps[key]
    extras.update(ps.get("extras") or {})
    return extras
