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


class SecretKeySelector(Model):
    """A key of a Secret in the pipeline's namespace."""

    name: str = Field(min_length=1, max_length=253, description="Secret name.")
    key: str = Field(min_length=1, max_length=253, pattern=r"^[-._a-zA-Z0-9]+$", description="Key in the Secret.")


class IPBlock(Model):
    """A CIDR range, as in a NetworkPolicy peer."""

    cidr: str = Field(min_length=1, max_length=64, description="The range, e.g. 2001:db8::/64.")
    except_: list[Annotated[str, Field(max_length=64)]] = Field(
        default_factory=list, alias="except", max_length=64, description="Ranges inside cidr to leave out.")


class NetworkPolicyPeer(Model):
    """Who may reach a port: pods by label, namespaces by label, or a CIDR range (one NetworkPolicy peer)."""

    model_config = ConfigDict(json_schema_extra=cel(
        ("has(self.podSelector) || has(self.namespaceSelector) || has(self.ipBlock)",
         "set podSelector, namespaceSelector or ipBlock"),
        ("!has(self.ipBlock) || (!has(self.podSelector) && !has(self.namespaceSelector))",
         "ipBlock does not combine with selectors"),
    ))

    pod_selector: FreeForm | None = Field(None, description="A label selector of pods.")
    namespace_selector: FreeForm | None = Field(None, description="A label selector of namespaces.")
    ip_block: IPBlock | None = Field(None, description="A CIDR range.")


class ApiLimits(Model):
    """Bounds the master's HTTP API enforces on every request (400 naming the field, or 429 when full)."""

    model_config = ConfigDict(json_schema_extra=cel(
        ("!has(self.requestTimeoutSeconds) || !has(self.maxRequestTimeoutSeconds) || "
         "self.requestTimeoutSeconds <= self.maxRequestTimeoutSeconds",
         "requestTimeoutSeconds must not exceed maxRequestTimeoutSeconds"),
    ))

    max_inflight: int = Field(
        256, ge=1, le=100000,
        description="Requests the master serves at once; more get 429 with Retry-After. Default: 256.")
    request_timeout_seconds: float = Field(
        600.0, gt=0, le=86400,
        description="Deadline of a request: past it the request is aborted in every stage and answered 504. "
        "A request may ask for another (`timeout`, seconds) up to maxRequestTimeoutSeconds. Default: 600.")
    max_request_timeout_seconds: float = Field(
        3600.0, gt=0, le=86400, description="The longest deadline a request may ask for. Default: 3600.")
    max_redispatches: int = Field(
        1, ge=0, le=10,
        description="Times a request is dispatched again after a replica holding it was lost. Default: 1.")
    max_body_bytes: int = Field(
        16 * 1024 * 1024, ge=1024, le=1024 * 1024 * 1024, description="Largest request body. Default: 16 MiB.")
    max_prompt_chars: int = Field(
        1_000_000, ge=1, le=100_000_000,
        description="Characters (or token ids) of a prompt, or of all chat messages together. Default: 1000000.")
    max_messages: int = Field(2048, ge=1, le=1_000_000, description="Chat messages per request. Default: 2048.")
    max_tokens: int = Field(
        32768, ge=1, le=10_000_000,
        description="Largest max_tokens (max_completion_tokens) a request, or any of its stages, may ask for. "
        "Default: 32768.")
    max_n: int = Field(16, ge=1, le=1024, description="Largest `n` (choices or images per request). Default: 16.")
    max_image_pixels: int = Field(
        4096 * 4096, ge=1, le=1 << 31,
        description="Pixels (width x height) of one image, asked for or encoded. Default: 16777216 (4096x4096).")
    max_audio_seconds: float = Field(
        600.0, gt=0, le=86400, description="Seconds of audio the master encodes for one request. Default: 600.")
    max_input_audio_seconds: float = Field(
        600.0, gt=0, le=86400,
        description="Seconds of one `input_audio` content part (read from its header, before decoding). Default: 600.")
    max_video_frames: int = Field(
        32, ge=1, le=4096,
        description="Frames taken from one `video_url` content part, sampled evenly over the video as vLLM's "
        "OpenCV loader samples them (all of a shorter one). Default: 32 (vLLM's own).")
    max_video_pixels: int = Field(
        32 * 1920 * 1080, ge=1, le=1 << 34,
        description="Pixels of the frames taken from one `video_url` part, all together (read from its header, "
        "before decoding): what the decoded video may hold in memory, 3 bytes each. Default: 66355200 "
        "(32 frames of 1920x1080).")


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
RESERVED_VOLUMES = ("config", "dshm", "models", "tmp", "keys")
RESERVED_MOUNT_PATHS = (C.CONFIG_DIR, C.SHM_DIR, C.MODEL_DIR, C.TMP_DIR, C.KEYS_DIR)


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


# What a stage's autoscaler holds at its target, per replica -> the series every stage pod exports for it
# (label `stage`; a pod of co-located stages exports each stage's own).
AUTOSCALING_METRICS = {
    "inflight": "omnifleet_worker_inflight",
    "queueDepth": "omnifleet_worker_queue_depth",
    "realTimeFactor": "omnifleet_worker_realtime_factor",
}
AUTOSCALING_DEFAULT_TARGETS = {"queueDepth": 2.0, "realTimeFactor": 0.5}


class Autoscaling(Model):
    """Let an autoscaler own a stage's replica count (an autoscaling/v2 HPA is rendered, on a pods metric the
    stage's pods export: the operator serves it to the HPA once manifests/autoscaling/ is applied, or
    prometheus-adapter does)."""

    model_config = ConfigDict(
        json_schema_extra=cel(("self.minReplicas <= self.maxReplicas", "minReplicas must not exceed maxReplicas"))
    )

    min_replicas: int = Field(
        1, ge=0, le=10000,
        description="Fewest replicas. 0: scale to zero when idle. The HPA then scales on the masters' demand "
        "for the stage (requests in flight on it or waiting for it; metric inflight only), and a request that "
        "finds no replica waits up to activationTimeoutSeconds for the first one (Kubernetes >= 1.37, or the "
        "HPAScaleToZero feature gate before).")
    max_replicas: int = Field(ge=1, le=10000, description="Most replicas.")
    metric: Literal["inflight", "queueDepth", "realTimeFactor"] | None = Field(
        None,
        description="What the autoscaler holds at `target` per replica: `inflight` (requests in the replica; LLM "
        "stages, which batch), `queueDepth` (requests waiting for an engine slot; stages of fixed concurrency), "
        "`realTimeFactor` (seconds of work per second of audio produced over the last minute; audio stages: "
        "below 1 is faster than real time). Series: " + ", ".join(f"{k} `{v}`" for k, v in
                                                                   AUTOSCALING_METRICS.items())
        + ". Default: realTimeFactor for a stage whose finalOutput is audio, else inflight.",
    )
    target: float | None = Field(
        None, gt=0, le=100000,
        description="The metric's target per replica. Default: targetInflight for inflight, "
        + ", ".join(f"{v:g} for {k}" for k, v in AUTOSCALING_DEFAULT_TARGETS.items()) + ".",
    )
    target_inflight: int = Field(
        4,
        ge=1,
        le=100000,
        description="Target in-flight requests per replica when the metric is inflight and `target` is unset.",
    )

    activation_timeout_seconds: float | None = Field(
        None, gt=0, le=3600,
        description="With minReplicas 0: how long a request waits for a stage scaled to zero to get a replica "
        "(scheduling, image pull, engine load) before it is answered 503. Default: 300.")
    scale_down_stabilization_seconds: int | None = Field(
        None,
        ge=0,
        le=3600,
        description="How long load must stay low before the autoscaler removes replicas (the HPA's "
        "behavior.scaleDown.stabilizationWindowSeconds). Default: the HPA's, 300 s: an engine reload costs "
        "minutes, so a short lull should not drop a replica.",
    )

    @property
    def activation_timeout(self) -> float:
        return 300.0 if self.activation_timeout_seconds is None else self.activation_timeout_seconds

    def metric_for(self, group: list["Stage"]) -> str:
        """The metric of a host stage's autoscaler; group: the host and the stages co-located in its pods."""
        return self.metric or ("realTimeFactor" if audio_stage(group) else "inflight")

    def target_for(self, group: list["Stage"]) -> float:
        metric = self.metric_for(group)
        if self.target is not None:
            return self.target
        return float(self.target_inflight) if metric == "inflight" else AUTOSCALING_DEFAULT_TARGETS[metric]

    def metric_stage(self, group: list["Stage"]) -> str | None:
        """The stage whose series the autoscaler reads: the pod's audio stage for realTimeFactor (None: the pod
        has none), else the host."""
        if self.metric_for(group) == "realTimeFactor":
            audio = audio_stage(group)
            return audio.name if audio else None
        return group[0].name


def audio_stage(group: list["Stage"]) -> "Stage | None":
    return next((s for s in group if s.final_output == "audio"), None)


class Heartbeat(Model):
    """Heartbeats between the master and stage replicas (both ways): how a silent peer is found.

    A process that exits closes its connection and is dropped at once; the
    timeout decides only silent failures (a lost node, a partition, a hung process).
    """

    model_config = ConfigDict(
        json_schema_extra=cel(
            ("!has(self.intervalSeconds) || !has(self.timeoutSeconds) || "
             "self.timeoutSeconds >= 2.0 * self.intervalSeconds",
             "timeoutSeconds must be at least twice intervalSeconds"),
        )
    )

    interval_seconds: float = Field(
        C.HEARTBEAT_INTERVAL_S, gt=0, le=60, description=f"Seconds between heartbeats. Default: {C.HEARTBEAT_INTERVAL_S:g}."
    )
    timeout_seconds: float = Field(
        C.HEARTBEAT_TIMEOUT_S, gt=0, le=3600,
        description=f"A peer silent this long is dead (its requests move or fail). Default: {C.HEARTBEAT_TIMEOUT_S:g}. "
        "A process that was itself stalled (CPU starvation, a paused VM) does not count the stall as silence.",
    )


class Monitoring(Model):
    """Objects of the Prometheus Operator (monitoring.coreos.com) that scrape this pipeline."""

    pod_monitor: bool = Field(
        False, description="Render a PodMonitor scraping the master (/metrics on its API port) and every stage "
        "pod (/metrics on port `metrics`). Needs the Prometheus Operator's CRDs.",
    )
    interval: str = Field("30s", pattern=r"^[0-9]+(ms|s|m|h)$", description="Scrape interval. Default: 30s.")
    labels: dict[str, str] = Field(
        default_factory=dict,
        description="Extra labels of the PodMonitor, e.g. the `release` label a Prometheus' podMonitorSelector matches.",
    )


class Master(Model):
    """The CPU-only master pod: orchestrator, registration server and HTTP API."""

    resources: Resources = Field(
        default_factory=lambda: Resources(
            requests={"cpu": "1", "memory": "2Gi"}, limits={"memory": "4Gi"}
        ),
        description="Master container resources. Default: requests cpu 1, memory 2Gi; limits memory 4Gi.",
    )
    replicas: int = Field(
        1, ge=1, le=16,
        description="Masters serving at once behind the master Service; every stage replica registers with each. "
        "A lost master costs only the requests it holds. Above 1 the masters get a PodDisruptionBudget.")
    api_port: int = Field(C.MASTER_API_PORT, ge=1, le=65535, description="Port of the OpenAI-compatible HTTP API.")
    service_type: ServiceType = Field("ClusterIP", description="Type of the master Service.")
    env: list[EnvVar] = Field(default_factory=list, max_length=128, description="Extra environment variables.")
    volumes: list[Volume] = Field(default_factory=list, max_length=32, description="Extra pod volumes.")
    volume_mounts: list[VolumeMount] = Field(
        default_factory=list, max_length=32, description="Mounts of `volumes` in the master container.")
    node_selector: dict[str, str] = Field(default_factory=dict, description="Node labels the master pod must match.")
    pod_annotations: dict[str, str] = Field(
        default_factory=dict, max_length=64, description="Annotations of the master pod (not omnifleet.dev/ keys).")
    tolerations: list[Toleration] = Field(default_factory=list, max_length=64, description="Tolerations of the master pod.")
    api_key_secret: SecretKeySelector | None = Field(
        None, description="A Secret key holding the API key of the inference endpoints: clients send "
        "`Authorization: Bearer <key>` (401 without it). Default: no key.")
    admin_token_secret: SecretKeySelector | None = Field(
        None, description="A Secret key holding the token of the admin port (`/v1/stages`, control RPCs): "
        "`Authorization: Bearer <token>`. Without it the admin endpoints refuse every call.")
    admin_sources: list[NetworkPolicyPeer] = Field(
        default_factory=list, max_length=32,
        description="NetworkPolicy peers (podSelector, namespaceSelector, ipBlock) allowed to reach the admin "
        "port. Default: none (kubectl port-forward still reaches it).")
    trust_request_chat_template: bool = Field(
        False, description="Let requests bring their own chat template (`chat_template`, "
        "`chat_template_kwargs.chat_template`); refused with 400 otherwise. Templates run code in the stages.")
    limits: ApiLimits = Field(default_factory=ApiLimits, description="Bounds of the HTTP API.")
    media_url_hosts: list[Annotated[str, Field(pattern=r"^[a-z0-9]([a-z0-9.-]*[a-z0-9])?$", max_length=253)]] = Field(
        default_factory=list, max_length=256,
        description="Hosts whose http(s) `image_url` and `video_url` parts the master fetches (bounded by "
        "maxBodyBytes, 10 s). Default: none: images and videos come as data URLs.")


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


class LoraAdapter(Model):
    """A LoRA adapter an llm stage serves beside its base model."""

    name: str = Field(
        pattern=DNS_LABEL, max_length=63,
        description="What a request names in `model` to use it; the stages that list it run it, the others their "
        "base model. Listed in /v1/models.")
    path: str = Field(
        min_length=1, max_length=1024,
        description="Folder of the adapter (PEFT layout: adapter_config.json, adapter_model.safetensors) in the "
        "stage's pods, e.g. in the model volume.")


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
    prompt_expand: CallableRef | None = Field(
        None,
        description="module:function making the classifier-free-guidance companions of each request from this "
        "stage's input, e.g. omnifleet_runtime.processors:negative_prompt (the request's negative_prompt). "
        "They run beside the request on the same replica; downstream input processors get their outputs as "
        "inputs named stage:role. Only on the entry stage or a stage whose inputMode is whole.",
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
    loras: list[LoraAdapter] = Field(
        default_factory=list, max_length=64,
        description="llm stages: LoRA adapters served beside the base model (vLLM's enable_lora; max_loras "
        "defaults to their count, max_lora_rank to vLLM's, both settable in engineArgs).")
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
    pod_annotations: dict[str, str] = Field(
        default_factory=dict, max_length=64,
        description="Annotations of this stage's pods, e.g. karpenter.sh/do-not-disrupt (not omnifleet.dev/ keys).")
    tolerations: list[Toleration] = Field(default_factory=list, max_length=64, description="Tolerations of this stage's pods.")
    affinity: FreeForm | None = Field(None, description="A Kubernetes Affinity for this stage's pods.")
    shm_size: Quantity = Field("1Gi", description="Size of the memory-backed /dev/shm.")
    colocate_with: str | None = Field(
        None, max_length=63,
        description="Run in the pods of this host stage, sharing its GPUs, /dev/shm, replicas and autoscaling.",
    )
    egress: Literal["pipeline", "any"] = Field(
        "pipeline",
        description="Where this stage's pods may connect: pipeline (the pipeline's own pods and DNS) or any "
        "(for stages that fetch models or call out). A co-located stage's pods allow any if one of its stages does.",
    )

    @property
    def is_colocated(self) -> bool:
        return self.colocate_with is not None

    def effective_input_mode(self) -> InputMode:
        if self.input_mode is not None:
            return self.input_mode
        return "stream" if self.type in ("python", "torch") else "whole"


class Security(Model):
    """How the pipeline's pods talk to each other."""

    data_plane: Literal["curve", "plain-auth"] = Field(
        "curve",
        description="Stage data ports: curve (CurveZMQ, authenticated and encrypted; a message of 1 MiB or more "
        "is sealed with AES-256-GCM under a fresh key sent over CurveZMQ, and travels over the stage's bulk port, "
        "data port + 100, with ZMQ PLAIN) or plain-auth (ZMQ PLAIN with the pipeline's token: authenticated, not "
        "encrypted; for networks that already encrypt, e.g. a service mesh or WireGuard). The master's control "
        "port always uses CurveZMQ.",
    )
    data_streams: int | None = Field(
        None, ge=1, le=16,
        description="Connections from a stage to each downstream port that carries large messages: the bulk port "
        "with curve (the sealed parts of a message go to them in turn), the data port with plain-auth (a message "
        "of 8 MiB or more is split over them). Default: from the CPUs the stage's container may use (its CPU "
        "limit, else the node's), one per two CPUs, at most 8 (one connection moves a buffer whole, with no "
        "reassembly copy; each further one costs both sides an I/O thread).",
    )
    check_peer_address: bool = Field(
        True,
        description="Refuse a stage registration whose advertised data address is not the IP its connection comes "
        "from. Turn off only behind a proxy that rewrites source addresses (a sidecar mesh such as Istio's, where "
        "connections arrive from 127.0.0.6).",
    )


class Rollout(Model):
    """How a change rolls the stage pods, the same for every stage.

    Each request runs through replicas of one revision of the pipeline. A new
    pod waits unready until every changed stage has a replica of the new
    revision; until then the old pods serve, then they drain. With no room for
    a surge pod, maxSurge 0 and maxUnavailable 1 trade one old pod for a new one
    at a time (a stage with one replica is then down while its new pod loads).
    """

    model_config = ConfigDict(
        json_schema_extra=cel(
            ("(has(self.maxSurge) ? self.maxSurge : 1) + (has(self.maxUnavailable) ? self.maxUnavailable : 0) > 0",
             "maxSurge and maxUnavailable cannot both be 0"),
        )
    )

    max_surge: int = Field(
        1, ge=0, le=1000, description="New pods a stage may have over its replicas during a rollout. Default: 1.")
    max_unavailable: int = Field(
        0, ge=0, le=1000, description="Pods a stage may have fewer than its replicas during a rollout. Default: 0.")



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
    security: Security = Field(default_factory=Security, description="Wire security between the pipeline's pods.")
    monitoring: Monitoring | None = Field(None, description="Prometheus Operator objects for this pipeline.")
    heartbeat: Heartbeat | None = Field(
        None, description="Heartbeat interval and timeout between master and stages. "
        f"Default: {C.HEARTBEAT_INTERVAL_S:g} s and {C.HEARTBEAT_TIMEOUT_S:g} s."
    )
    rollout: Rollout | None = Field(
        None, description="How a change rolls the stage pods. Default: maxSurge 1, maxUnavailable 0.")
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
    # The pipeline's metadata.generation, which the operator copies into the mounted config: stage replicas
    # announce it, and a master admits requests into the newest revision of the pipeline (see membership).
    generation: int | None = Field(default=None, ge=0)


class OmniPipeline(BaseModel):
    """A whole OmniPipeline document (the CR, a local file, or the mounted config)."""

    model_config = ConfigDict(extra="allow", frozen=True)
    api_version: Literal["omnifleet.dev/v1alpha1"] = Field(alias="apiVersion")
    kind: Literal["OmniPipeline"]
    metadata: ObjectMeta
    spec: PipelineSpec
