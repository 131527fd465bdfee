"""Names and numbers the operator and the runtime must agree on.

Light on purpose: imported by the operator, the renderer and every runtime
process. Nothing here imports anything beyond the standard library.
"""

GROUP = "omnifleet.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "OmniPipeline"
PLURAL = "omnipipelines"
SINGULAR = "omnipipeline"
SHORT_NAMES = ["omnip"]
CATEGORIES = ["omnifleet"]

# Ports are fixed and declared so Services and NetworkPolicies can name them.
MASTER_API_PORT = 8000
MASTER_CONTROL_PORT = 5570  # ROUTER: registration, heartbeats, requests and results
STAGE_DATA_PORT = 5580  # first stage data port in a pod; co-located stages add their index
STAGE_HEALTH_PORT = 8081  # HTTP /livez and /readyz of a stage pod

PORT_NAME_HTTP = "http"
PORT_NAME_CONTROL = "zmq-control"
PORT_NAME_DATA = "zmq-data"
PORT_NAME_HEALTH = "health"

# Where the operator mounts things and where the runtime looks for them.
CONFIG_DIR = "/etc/omnifleet"
CONFIG_FILE = "pipeline.yaml"
CONFIG_PATH = f"{CONFIG_DIR}/{CONFIG_FILE}"
MODEL_DIR = "/models"
SHM_DIR = "/dev/shm"
TMP_DIR = "/tmp"  # an emptyDir: the root filesystem is read-only

# Wire protocol version; a stage whose version differs is refused at registration.
PROTOCOL_VERSION = 1

# The project's version (pyproject.toml's; a unit test keeps them equal) names the images.
PROJECT_VERSION = "0.1.0"
DEFAULT_IMAGE = f"ghcr.io/omnifleet/omnifleet:{PROJECT_VERSION}"  # runtime/Dockerfile: master and stage pods
OPERATOR_IMAGE = f"ghcr.io/omnifleet/omnifleet-operator:{PROJECT_VERSION}"  # operator/Dockerfile
FIELD_MANAGER = "omnifleet"

# Label and annotation keys.
LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_PART_OF = "app.kubernetes.io/part-of"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_PIPELINE = "omnifleet.dev/pipeline"
LABEL_STAGE = "omnifleet.dev/stage"
LABEL_OF_COMPONENT = "omnifleet.dev/component"
ANNOTATION_CONFIG_HASH = "omnifleet.dev/config-hash"
ANNOTATION_TEMPLATE_HASH = "omnifleet.dev/template-hash"
ANNOTATION_STAGES = "omnifleet.dev/stages"

COMPONENT_MASTER = "master"
COMPONENT_STAGE = "stage"

# Environment the runtime reads (set by the renderer, and by the local runner).
ENV_POD_NAME = "OMNIFLEET_POD_NAME"
ENV_POD_NAMESPACE = "OMNIFLEET_NAMESPACE"
ENV_POD_IP = "OMNIFLEET_POD_IP"  # advertised for stage-to-stage data

# Liveness between master and stage replicas. A process that exits (crash,
# OOM kill, pod deleted) closes its connection, and the other side acts on
# that within milliseconds. Heartbeats, both ways, catch the silent failures
# (a lost node, a partition, a hung process): a peer silent for
# HEARTBEAT_TIMEOUT_S is dead. Starved processes go silent for seconds (up to
# 4.6 s measured on a busy 2-core machine running two vLLM engines; CPU-
# throttled pods do the same), so the timeout leaves room for that rather
# than failing their requests.
HEARTBEAT_INTERVAL_S = 0.5
HEARTBEAT_TIMEOUT_S = 10.0
# How long an accepted request waits for a replica of a stage that has none.
REPLICA_WAIT_TIMEOUT_S = 30.0
# Default deadline of a control RPC to the replicas of a stage.
CONTROL_TIMEOUT_S = 10.0
# How long a stage finishes in-flight work after SIGTERM before it aborts it.
DRAIN_TIMEOUT_S = 30.0
# Exit status of a stage whose protocol version the master refused.
EXIT_PROTOCOL_MISMATCH = 3
# A stage whose engine has not loaded in this long gives up and exits (its pod restarts); per stage:
# spec.stages[].engineStartTimeoutSeconds. Large models on slow volumes take many minutes.
ENGINE_START_TIMEOUT_S = 1800
# How often a stage asks its engine whether it is still alive (vLLM: its engine core process).
ENGINE_WATCH_INTERVAL_S = 0.2
EXIT_ENGINE_START_TIMEOUT = 4
EXIT_ENGINE_DIED = 5
