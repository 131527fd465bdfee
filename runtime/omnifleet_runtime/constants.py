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
MASTER_ADMIN_PORT = 8001  # HTTP /v1/stages and control RPCs; not in the master Service clients use
STAGE_DATA_PORT = 5580  # first stage data port in a pod; co-located stages add their index
# A `curve` pipeline's stage also listens on its data port + this: the bulk port (seal.py).
BULK_PORT_OFFSET = 100
STAGE_HEALTH_PORT = 8081  # HTTP /livez and /readyz of a stage pod
STAGE_METRICS_PORT = 8082  # HTTP /metrics of a stage pod (the master's are on its API port)

PORT_NAME_HTTP = "http"
PORT_NAME_CONTROL = "zmq-control"
PORT_NAME_ADMIN = "admin"
PORT_NAME_DATA = "zmq-data"
PORT_NAME_BULK = "zmq-bulk"
PORT_NAME_HEALTH = "health"
PORT_NAME_METRICS = "metrics"

# Where the operator mounts things and where the runtime looks for them.
CONFIG_DIR = "/etc/omnifleet"
CONFIG_FILE = "pipeline.yaml"
CONFIG_PATH = f"{CONFIG_DIR}/{CONFIG_FILE}"
MODEL_DIR = "/models"
SHM_DIR = "/dev/shm"
TMP_DIR = "/tmp"  # an emptyDir: the root filesystem is read-only
# The pipeline's keys (its Secret), a directory of its own: a volume cannot mount inside a ConfigMap's.
KEYS_DIR = "/etc/omnifleet-keys"
# The Secret of a pipeline's keys is `<pipeline>-keys`; other pipelines may not reference such names.
KEYS_SECRET_SUFFIX = "-keys"
# Its files (see security.py): CURVE keypairs of the listening and the connecting sockets, a PLAIN token.
KEY_FILES = ("server.public", "server.secret", "client.public", "client.secret", "token")

# Wire protocol version; a stage whose version differs is refused at registration.
PROTOCOL_VERSION = 3  # 2: striped data-port messages (stripes.py); 3: a Data chunk may end its stage (last)

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
ANNOTATION_DOMAIN = "omnifleet.dev"  # annotation and label keys of this domain are the operator's
ANNOTATION_CONFIG_HASH = "omnifleet.dev/config-hash"
ANNOTATION_TEMPLATE_HASH = "omnifleet.dev/template-hash"
ANNOTATION_STAGES = "omnifleet.dev/stages"
ANNOTATION_KEYS_HASH = "omnifleet.dev/keys-hash"  # pod templates: a changed Secret rolls the pods

COMPONENT_MASTER = "master"
COMPONENT_STAGE = "stage"

# Environment the runtime reads (set by the renderer, and by the local runner).
ENV_POD_NAME = "OMNIFLEET_POD_NAME"
ENV_POD_NAMESPACE = "OMNIFLEET_NAMESPACE"
ENV_POD_IP = "OMNIFLEET_POD_IP"  # advertised for stage-to-stage data
ENV_KEYS_DIR = "OMNIFLEET_KEYS_DIR"  # where the pipeline's keys are (default KEYS_DIR)
ENV_API_KEY = "OMNIFLEET_API_KEY"  # bearer key of the inference endpoints (from spec.master.apiKeySecret)
ENV_ADMIN_TOKEN = "OMNIFLEET_ADMIN_TOKEN"  # bearer token of the admin port (from spec.master.adminTokenSecret)
# Defaults of the master's --drain-linger and --drain-quiet, settable through spec.master.env where a
# cluster's proxies take longer to drop a terminating endpoint.
ENV_DRAIN_LINGER = "OMNIFLEET_DRAIN_LINGER_SECONDS"
ENV_DRAIN_QUIET = "OMNIFLEET_DRAIN_QUIET_SECONDS"

# Liveness between master and stage replicas. A process that exits (crash,
# OOM kill, pod deleted) closes its connection, and the other side acts on
# that within milliseconds. Heartbeats, both ways, catch the silent failures
# (a lost node, a partition, a hung process): a peer silent for
# HEARTBEAT_TIMEOUT_S is dead. A process that was itself starved (CPU, a
# paused VM, a throttled pod) credits its own stall instead of blaming its
# peers, so the default stays short; spec.heartbeat and the master's and
# stage's flags set others (busy test machines running vLLM engines starved
# whole fleets for up to 4.6 s: their tests set a longer timeout).
# A stage worker's registration, as its pod's /readyz reads it: serving (the master routes to it), registered
# but waiting (no master serves its revision yet), or not registered.
WORKER_UNREGISTERED, WORKER_SERVING, WORKER_WAITING = 0, 1, 2
# A new master's pod turns ready once every stage registered with it, or this long after it started.
MASTER_WARMUP_S = 30.0
HEARTBEAT_INTERVAL_S = 0.5
HEARTBEAT_TIMEOUT_S = 2.0
# How long an accepted request waits for a replica of a stage that has none.
REPLICA_WAIT_TIMEOUT_S = 30.0
# Default deadline of a control RPC to the replicas of a stage, and the most a caller may ask for.
CONTROL_TIMEOUT_S = 10.0
CONTROL_TIMEOUT_MAX_S = 300.0
# How long a stage finishes in-flight work after SIGTERM before it aborts it.
DRAIN_TIMEOUT_S = 30.0
# A stage worker still running this long after its drain deadline is stuck in its shutdown (a thread that
# never ends, an engine that does not stop; the vllm engine itself waits up to 30 s for its core): its
# threads' stacks are logged and it is killed, so the pod ends inside its termination grace period (the
# operator's 120 s, past drain and this) with the reason in its log.
STAGE_EXIT_TIMEOUT_S = 60.0
MASTER_DRAIN_TIMEOUT_S = 20.0  # within the master pod's 30 s termination grace period
# After SIGTERM the master keeps its API port open (answering 503) at least this long: the Service's
# endpoint removal reaches every node's proxy only after a while, and a listener closed sooner resets
# the connections routed to it meanwhile (a request sent and lost instead of a clear error).
MASTER_DRAIN_LINGER_S = 5.0
# After that linger it stays until no client request has come for this long (within its drain timeout):
# requests still arriving mean some proxy still routes here, however long the endpoint removal takes.
MASTER_DRAIN_QUIET_S = 1.0
# Exit status of a stage whose protocol version the master refused.
EXIT_PROTOCOL_MISMATCH = 3
# A stage whose engine has not loaded in this long gives up and exits (its pod restarts); per stage:
# spec.stages[].engineStartTimeoutSeconds. Large models on slow volumes take many minutes.
ENGINE_START_TIMEOUT_S = 1800
# How often a stage asks its engine whether it is still alive (vLLM: its engine core process).
ENGINE_WATCH_INTERVAL_S = 0.2
EXIT_ENGINE_START_TIMEOUT = 4
EXIT_ENGINE_DIED = 5

# Bounds on what a peer may send, checked before a message is decoded. A frame
# over the size is refused by ZMQ itself (MAXMSGSIZE: the connection is closed
# before the frame is allocated); a message over the frame count or the total
# is read frame by frame, dropped and counted. Data ports carry bulk tensors;
# the control port carries control messages and final outputs.
MAX_DATA_FRAME_BYTES = 1 << 30
MAX_CONTROL_FRAME_BYTES = 256 << 20
MAX_FRAMES = 4096
# Registrations per stage: a flood of (keyed) registrations cannot grow
# membership without bound. At least this many, more when the spec asks for more.
MIN_REPLICAS_BOUND = 64

# The window of a stage's real-time-factor gauge (its autoscaling metric for audio stages).
RTF_WINDOW_S = 60.0
# The masters' demand for a stage (requests in flight on it or waiting for a replica), label `stage`:
# what the HPA of a stage that scales to zero reads, as an object metric of the master Service.
STAGE_DEMAND_METRIC = "omnifleet_stage_demand"
