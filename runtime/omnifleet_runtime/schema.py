"""The OmniPipeline schema: the one source of truth.

The CRD's OpenAPI schema is generated from these models, the operator
validates custom resources with them, and the runtime parses its mounted
config with them. Keep imports light: pydantic and the standard library only.

CEL rules attached with `cel(...)` are enforced by the API server; every one
of them is also checked in Python by `omnifleet_runtime.validate`, so a file
run locally gets the same answers as a `kubectl apply`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, WithJsonSchema
from pydantic.alias_generators import to_camel

from . import constants as C

DNS_LABEL = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
# `package.module:function` (the function part may be dotted: `mod:Class.method`).
CALLABLE_REF = rf"^{IDENT}(\.{IDENT})*:{IDENT}(\.{IDENT})*$"
# vLLM-Omni names callables as dotted paths (`package.module.function`).
DOTTED_REF = rf"^{IDENT}(\.{IDENT})+$"
QUANTITY = r"^[+]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][-+]?[0-9]+|[numkMGTPE]i?|Ki)?$"

MAX_STAGES = 32
MAX_INPUTS = 16

StageType = Literal["llm", "diffusion", "python", "torch", "vllm-omni"]
FinalOutput = Literal["text", "audio", "image", "video", "action", "none"]
InputMode = Literal["stream", "whole"]
ServiceType = Literal["ClusterIP", "NodePort", "LoadBalancer"]


def _quantity_to_str(value: Any) -> Any:
    # YAML turns `cpu: 2` into an int; Kubernetes accepts both.
    if isinstance(value, bool):
        return value  # rejected by the str pattern below
    if isinstance(value, (int, float)):
        return str(value)
    return value


Quantity = Annotated[
    str,
    BeforeValidator(_quantity_to_str),
    Field(pattern=QUANTITY),
    WithJsonSchema(
        {"x-kubernetes-int-or-string": True, "anyOf": [{"type": "integer"}, {"type": "string"}]}
    ),
]

FreeForm = Annotated[
    dict[str, Any],
    WithJsonSchema({"type": "object", "x-kubernetes-preserve-unknown-fields": True}),
]

CallableRef = Annotated[str, Field(pattern=CALLABLE_REF, max_length=256)]


def cel(*rules: tuple[str, str]) -> dict[str, Any]:
    """CEL rules for the API server, as (rule, message) pairs."""
    return {"x-kubernetes-validations": [{"rule": r, "message": m} for r, m in rules]}


class Model(BaseModel):
    """camelCase on the wire, snake_case in Python, unknown fields refused."""

    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True
    )


class Resources(Model):
    """Compute resources, as in a container's `resources`."""

    requests: dict[str, Quantity] = Field(
        default_factory=dict, description="Minimum resources, e.g. {cpu: 2, memory: 8Gi}."
    )
    limits: dict[str, Quantity] = Field(
        default_factory=dict,
        description="Maximum resources. `nvidia.com/gpu` is set from the stage's `gpus` field; do not set it here.",
    )


class EnvVar(Model):
    """An environment variable: a literal `value` or a `valueFrom` source."""

    name: str = Field(pattern=r"^[-._a-zA-Z][-._a-zA-Z0-9]*$", max_length=256, description="Variable name.")
    value: str | None = Field(None, description="Literal value.")
    value_from: FreeForm | None = Field(
        None, description="A Kubernetes EnvVarSource (secretKeyRef, configMapKeyRef, fieldRef, ...)."
    )


class Toleration(Model):
    """A Kubernetes toleration."""

    key: str | None = Field(None, description="Taint key; empty with operator Exists matches all.")
    operator: Literal["Exists", "Equal"] | None = Field(None, description="Exists or Equal. Default: Equal.")
    value: str | None = Field(None, description="Taint value for operator Equal.")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        None, description="Taint effect to match; empty matches all."
    )
    toleration_seconds: int | None = Field(None, description="How long a NoExecute taint is tolerated.")


class LocalObjectReference(Model):
    """A reference to an object in the pipeline's namespace."""

    name: str = Field(min_length=1, max_length=253, description="Object name.")


class ModelVolume(Model):
    """Where model weights live; mounted read-only at /models in every stage pod."""

    model_config = ConfigDict(
        json_schema_extra=cel(
            ("has(self.claimName) != has(self.hostPath)", "set exactly one of claimName or hostPath"),
        )
    )

    claim_name: str | None = Field(
        None, min_length=1, max_length=253, description="Name of a PersistentVolumeClaim holding the weights."
    )
    host_path: str | None = Field(
        None, pattern=r"^/", max_length=4096, description="A node directory holding the weights (absolute path)."
    )
    sub_path: str | None = Field(
        None, max_length=4096, description="Directory inside the volume to mount instead of its root."
    )


# Volume sources a pipeline may mount: those Pod Security "restricted" admits (no hostPath).
VOLUME_SOURCES = ("configMap", "secret", "emptyDir", "persistentVolumeClaim", "projected",
                  "downwardAPI", "csi", "ephemeral")
# Names and paths the operator's own volumes use in every pod.
RESERVED_VOLUMES = ("config", "dshm", "models", "tmp")
RESERVED_MOUNT_PATHS = (C.CONFIG_DIR, C.SHM_DIR, C.MODEL_DIR, C.TMP_DIR)


class Volume(Model):
    """A pod volume (a core/v1 Volume with one of the sources below), e.g. user code from a ConfigMap."""

    model_config = ConfigDict(
        json_schema_extra=cel(
            (" + ".join(f"(has(self.{v}) ? 1 : 0)" for v in VOLUME_SOURCES) + " == 1",
             "set exactly one volume source: " + ", ".join(VOLUME_SOURCES)),
        )
    )

    name: str = Field(pattern=DNS_LABEL, max_length=63, description="Volume name, unique in the pod.")
    config_map: FreeForm | None = Field(None, description="A core/v1 ConfigMapVolumeSource.")
    secret: FreeForm | None = Field(None, description="A core/v1 SecretVolumeSource.")
    empty_dir: FreeForm | None = Field(None, description="A core/v1 EmptyDirVolumeSource.")
    persistent_volume_claim: FreeForm | None = Field(None, description="A core/v1 PersistentVolumeClaimVolumeSource.")
    projected: FreeForm | None = Field(None, description="A core/v1 ProjectedVolumeSource.")
    downward_api: FreeForm | None = Field(
        None, alias="downwardAPI", description="A core/v1 DownwardAPIVolumeSource.")
    csi: FreeForm | None = Field(None, description="A core/v1 CSIVolumeSource.")
    ephemeral: FreeForm | None = Field(None, description="A core/v1 EphemeralVolumeSource.")


class VolumeMount(Model):
    """Where a volume of `volumes` is mounted in the container."""

    name: str = Field(pattern=DNS_LABEL, max_length=63, description="Name of a volume in `volumes`.")
    mount_path: str = Field(pattern=r"^/", max_length=4096, description="Absolute path in the container.")
    read_only: bool | None = Field(None, description="Mount read-only. Default: false.")
    sub_path: str | None = Field(None, max_length=4096, description="Path inside the volume to mount instead of its root.")


class Autoscaling(Model):
    """Let an autoscaler own a stage's replica count (an autoscaling/v2 HPA is rendered)."""

    model_config = ConfigDict(
        json_schema_extra=cel(("self.minReplicas <= self.maxReplicas", "minReplicas must not exceed maxReplicas"))
    )

    min_replicas: int = Field(1, ge=1, le=10000, description="Fewest replicas.")
    max_replicas: int = Field(ge=1, le=10000, description="Most replicas.")
    target_inflight: int = Field(
        4,
        ge=1,
        le=100000,
        description="Target in-flight requests per replica (pods metric `omnifleet_stage_inflight`).",
    )


class Master(Model):
    """The CPU-only master pod: orchestrator, registration server and HTTP API."""

    resources: Resources = Field(
        default_factory=lambda: Resources(
            requests={"cpu": "1", "memory": "2Gi"}, limits={"memory": "4Gi"}
        ),
        description="Master container resources. Default: requests cpu 1, memory 2Gi; limits memory 4Gi.",
    )
    api_port: int = Field(C.MASTER_API_PORT, ge=1, le=65535, description="Port of the OpenAI-compatible HTTP API.")
    service_type: ServiceType = Field("ClusterIP", description="Type of the master Service.")
    env: list[EnvVar] = Field(default_factory=list, max_length=128, description="Extra environment variables.")
    volumes: list[Volume] = Field(default_factory=list, max_length=32, description="Extra pod volumes.")
    volume_mounts: list[VolumeMount] = Field(
        default_factory=list, max_length=32, description="Mounts of `volumes` in the master container.")
    node_selector: dict[str, str] = Field(default_factory=dict, description="Node labels the master pod must match.")
    tolerations: list[Toleration] = Field(default_factory=list, max_length=64, description="Tolerations of the master pod.")


class VllmOmniStage(Model):
    """What a vLLM-Omni stage engine needs beyond the engine args: its place in vLLM-Omni's own
    pipeline topology (as `omnifleet import vllm-omni` resolves it from a deploy file)."""

    pipeline: str = Field(
        pattern=r"^[A-Za-z0-9_.-]+$", max_length=128,
        description="vLLM-Omni pipeline registry key whose topology this stage belongs to (e.g. qwen2_5_omni).",
    )
    stage_id: int = Field(ge=0, le=1024, description="The stage's id in that topology.")
    model_stage: str = Field(max_length=128, description="vLLM-Omni's model stage (thinker, talker, code2wav, ...).")
    worker_type: Literal["ar", "generation", "diffusion"] = Field(
        description="ar: autoregressive vLLM engine core; generation: non-autoregressive vLLM engine core; "
        "diffusion: vLLM-Omni's diffusion engine.",
    )
    input_processor: str | None = Field(
        None, pattern=DOTTED_REF, max_length=256,
        description="vLLM-Omni's stage input processor (dotted path), run in this stage on its upstream outputs.",
    )
    async_chunk: bool = Field(
        False, description="Stream chunks from upstream as they are produced (vLLM-Omni's async_chunk).",
    )
    devices: str | None = Field(
        None, pattern=r"^[0-9]+(,[0-9]+)*$", max_length=256,
        description="The pod's GPUs this stage uses, as indices into the pod's GPUs (CUDA_VISIBLE_DEVICES "
        "order). Default: all of them.",
    )
    stage_config: FreeForm = Field(
        default_factory=dict,
        description="The rest of vLLM-Omni's per-stage config (hf_config_name, scheduler_cls, connectors, "
        "sampling constraints, ...), passed to its stage engine as it is.",
    )


class Stage(Model):
    """One stage of the pipeline: an engine core fed by its upstream stages."""

    model_config = ConfigDict(
        json_schema_extra=cel(
            ("self.type != 'python' && self.type != 'torch' || has(self.entrypoint)",
             "entrypoint is required for python and torch stages"),
            ("self.type != 'llm' || !has(self.entrypoint)", "entrypoint is not used by llm stages"),
            ("self.type != 'vllm-omni' || (has(self.vllmOmni) && !has(self.entrypoint))",
             "vllm-omni stages need vllmOmni and take no entrypoint"),
            ("self.type == 'vllm-omni' || !has(self.vllmOmni)", "vllmOmni is only for vllm-omni stages"),
            ("!has(self.colocateWith) || (!has(self.gpus) && !has(self.replicas) && !has(self.autoscaling))",
             "a co-located stage shares its host's gpus, replicas and autoscaling; do not set them"),
            ("!(has(self.replicas) && has(self.autoscaling))", "set replicas or autoscaling, not both"),
            ("!has(self.colocateWith) || self.colocateWith != self.name", "a stage cannot be co-located with itself"),
            ("!has(self.inputs) || !self.inputs.exists(i, i == self.name)", "a stage cannot be its own input"),
        )
    )

    name: str = Field(
        pattern=DNS_LABEL, max_length=50,
        description="Stage name, a DNS label unique in the pipeline; part of generated object names.",
    )
    type: StageType = Field(
        description="Engine kind: llm (vLLM), diffusion (diffusers or a torch module), "
        "python (entrypoint is a module:callable), torch (entrypoint is a module:factory returning an nn.Module), "
        "vllm-omni (one of vLLM-Omni's stage engines, described by vllmOmni).",
    )
    entrypoint: CallableRef | None = Field(
        None, description="module:callable of a python stage, module:factory of a torch or custom diffusion stage."
    )
    model: str | None = Field(None, max_length=1024, description="Model of this stage. Default: spec.model.")
    image: str | None = Field(None, max_length=1024, description="Container image of this stage. Default: spec.image.")
    gpus: int | None = Field(
        None, ge=0, le=64,
        description="GPUs per replica (the nvidia.com/gpu limit); 0 runs on CPU. Default: 1. Not set on co-located stages.",
    )
    replicas: int | None = Field(
        None, ge=0, le=10000, description="Replica count. Default: 1. Not set with autoscaling or on co-located stages."
    )
    autoscaling: Autoscaling | None = Field(
        None, description="Let an HPA own the replica count instead of `replicas`."
    )
    inputs: list[Annotated[str, Field(max_length=63)]] = Field(
        default_factory=list, max_length=MAX_INPUTS,
        description="Names of upstream stages. The one entry stage has none and receives the client request.",
    )
    input_processor: CallableRef | None = Field(
        None, description="module:function turning upstream outputs into this stage's inputs. Default: pass through."
    )
    input_mode: InputMode | None = Field(
        None,
        description="stream: start on chunks of the upstream output as they arrive; whole: wait for the full "
        "upstream output. Default: stream for python and torch stages, whole for llm and diffusion stages.",
    )
    final_output: FinalOutput = Field(
        "none", description="What this stage returns to the client (text, audio, image, video, action) or none."
    )
    engine_args: FreeForm = Field(
        default_factory=dict, description="Engine arguments, passed as they are (e.g. vLLM's max_model_len)."
    )
    sampling_params: FreeForm = Field(
        default_factory=dict, description="Default sampling parameters; a request can override them per stage."
    )
    vllm_omni: VllmOmniStage | None = Field(None, description="The vLLM-Omni stage this vllm-omni stage runs.")
    engine_start_timeout_seconds: int | None = Field(
        None, ge=1, le=86400,
        description="Seconds the engine may take to load and warm up; past that the stage stops it and exits "
        f"non-zero, and its pod restarts. Default: {C.ENGINE_START_TIMEOUT_S}.",
    )
    resources: Resources = Field(default_factory=Resources, description="Container resources (besides GPUs).")
    env: list[EnvVar] = Field(default_factory=list, max_length=128, description="Extra environment variables.")
    volumes: list[Volume] = Field(
        default_factory=list, max_length=32,
        description="Extra pod volumes, e.g. a ConfigMap holding the code of a python stage "
        "(mount it and put its path on PYTHONPATH through env).")
    volume_mounts: list[VolumeMount] = Field(
        default_factory=list, max_length=32,
        description="Mounts of this stage's `volumes` (of its host's and its own, for a co-located stage).")
    node_selector: dict[str, str] = Field(default_factory=dict, description="Node labels this stage's pods must match.")
    tolerations: list[Toleration] = Field(default_factory=list, max_length=64, description="Tolerations of this stage's pods.")
    affinity: FreeForm | None = Field(None, description="A Kubernetes Affinity for this stage's pods.")
    shm_size: Quantity = Field("1Gi", description="Size of the memory-backed /dev/shm.")
    colocate_with: str | None = Field(
        None, max_length=63,
        description="Run in the pods of this host stage, sharing its GPUs, /dev/shm, replicas and autoscaling.",
    )

    @property
    def is_colocated(self) -> bool:
        return self.colocate_with is not None

    def effective_input_mode(self) -> InputMode:
        if self.input_mode is not None:
            return self.input_mode
        return "stream" if self.type in ("python", "torch") else "whole"


class PipelineSpec(Model):
    """The desired state of an OmniPipeline."""

    model_config = ConfigDict(
        json_schema_extra=cel(
            ("self.stages.all(s, self.stages.exists_one(t, t.name == s.name))", "stage names must be unique"),
            ("self.stages.all(s, !has(s.inputs) || s.inputs.all(i, self.stages.exists(t, t.name == i)))",
             "every input must name a stage of this pipeline"),
            ("self.stages.filter(s, !has(s.inputs) || size(s.inputs) == 0).size() == 1",
             "exactly one stage must have no inputs (the entry stage)"),
            ("self.stages.exists(s, has(s.finalOutput) && s.finalOutput != 'none')",
             "at least one stage must have a finalOutput"),
            ("self.stages.all(s, !has(s.colocateWith) || self.stages.exists(t, t.name == s.colocateWith && !has(t.colocateWith)))",
             "colocateWith must name a stage that is not itself co-located"),
        )
    )

    model: str | None = Field(None, max_length=1024, description="Default model of every stage (a path under /models or a name).")
    image: str = Field(C.DEFAULT_IMAGE, max_length=1024, description="Default container image of the master and every stage.")
    image_pull_secrets: list[LocalObjectReference] = Field(
        default_factory=list, max_length=16, description="Secrets for pulling the images."
    )
    model_volume: ModelVolume | None = Field(None, description="Volume with model weights, mounted read-only at /models.")
    master: Master = Field(default_factory=Master, description="The master pod.")
    stages: list[Stage] = Field(min_length=1, max_length=MAX_STAGES, description="The stages, in any order.")

    def stage(self, name: str) -> Stage:
        for s in self.stages:
            if s.name == name:
                return s
        raise KeyError(name)

    def hosts(self) -> list[Stage]:
        """Stages that own pods (those not co-located into another)."""
        return [s for s in self.stages if not s.is_colocated]

    def group(self, host: str) -> list[Stage]:
        """A host stage followed by the stages co-located in its pods."""
        return [self.stage(host)] + [s for s in self.stages if s.colocate_with == host]


class ObjectMeta(BaseModel):
    """The part of metadata a pipeline file needs (others are kept, not used)."""

    model_config = ConfigDict(extra="allow", frozen=True)
    name: str = Field(min_length=1, max_length=253)
    namespace: str | None = None


class OmniPipeline(BaseModel):
    """A whole OmniPipeline document (the CR, a local file, or the mounted config)."""

    model_config = ConfigDict(extra="allow", frozen=True)
    api_version: Literal["omnifleet.dev/v1alpha1"] = Field(alias="apiVersion")
    kind: Literal["OmniPipeline"]
    metadata: ObjectMeta
    spec: PipelineSpec
