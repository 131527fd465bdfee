"""`omnifleet master` and `omnifleet stage`: what the operator renders into pods.

Both read the pipeline file (the mounted ConfigMap by default). Every port
and address flag has a default for Kubernetes (fixed, declared ports) and an
override for local runs and tests.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import socket
import sys

from . import constants as C
from .validate import InvalidPipeline


def setup_logging(level: str, name: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO), stream=sys.stderr, force=True,
        format=f"%(asctime)s %(levelname)s [{name}] %(name)s: %(message)s",
    )


def _load(path: str):
    from .config import load_config

    try:
        return load_config(path)
    except OSError as e:
        sys.exit(f"omnifleet: cannot read the pipeline config {path}: {e}")
    except InvalidPipeline as e:
        sys.exit(f"omnifleet: invalid pipeline config {path}:\n  " + "\n  ".join(map(str, e.problems)))


def _keys(flag: str | None):
    from .security import Keys, KeysError, keys_dir

    try:
        return Keys.load(keys_dir(flag))
    except KeysError as e:
        sys.exit(f"omnifleet: {e}")


def _add_security_flags(p: argparse.ArgumentParser, max_frame_bytes: int) -> None:
    p.add_argument("--keys-dir", default=None,
                   help=f"directory of the pipeline's keys (default: ${C.ENV_KEYS_DIR}, else {C.KEYS_DIR})")
    p.add_argument("--max-frame-bytes", type=int, default=max_frame_bytes,
                   help="largest frame a peer may send; a larger one closes its connection (default: %(default)s)")


def _seconds(flag: float | None, name: str, default: float) -> float:
    """A duration from its flag, else from the environment (spec.master.env), else the default; a bad value in
    the environment stops the command, naming the variable."""
    if flag is not None:
        return flag
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise SystemExit(f"{name}={raw[:32]!r}: must be a number of seconds, 0 or more")
    return value


def _heartbeat_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--heartbeat-interval", type=float, default=None,
                   help=f"seconds between heartbeats (default: spec.heartbeat, else {C.HEARTBEAT_INTERVAL_S:g})")
    p.add_argument("--heartbeat-timeout", type=float, default=None,
                   help=f"seconds of silence after which a peer is dead (default: spec.heartbeat, else "
                        f"{C.HEARTBEAT_TIMEOUT_S:g})")


def _heartbeat(doc, args) -> tuple[float, float]:
    from .config import heartbeat

    for flag in ("heartbeat_interval", "heartbeat_timeout"):
        value = getattr(args, flag)
        if value is not None and not value > 0:
            sys.exit(f"omnifleet: --{flag.replace('_', '-')} must be a positive number of seconds, got {value:g}")
    try:
        return heartbeat(doc, args.heartbeat_interval, args.heartbeat_timeout)
    except ValueError as e:
        sys.exit(f"omnifleet: {e}")


def master(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="omnifleet master", description="Run the pipeline's master (CPU only).")
    p.add_argument("--config", default=C.CONFIG_PATH, help="pipeline file (default: %(default)s)")
    p.add_argument("--host", default="0.0.0.0", help="address to bind (default: %(default)s)")
    p.add_argument("--api-port", type=int, help="HTTP API port (default: spec.master.apiPort)")
    p.add_argument("--control-port", type=int, default=C.MASTER_CONTROL_PORT,
                   help="ZMQ control port stages connect to (default: %(default)s)")
    p.add_argument("--replica-wait-timeout", type=float, default=C.REPLICA_WAIT_TIMEOUT_S,
                   help="seconds an accepted request waits for a stage with no replica (default: %(default)s)")
    p.add_argument("--drain-timeout", type=float, default=C.MASTER_DRAIN_TIMEOUT_S,
                   help="seconds to finish in-flight requests after SIGTERM (default: %(default)s)")
    p.add_argument("--drain-linger", type=float, default=None,
                   help="seconds the API keeps answering (503) after SIGTERM, at least, so that requests "
                        f"routed here before the endpoint removal reached every proxy get an answer (default: "
                        f"${C.ENV_DRAIN_LINGER}, else {C.MASTER_DRAIN_LINGER_S:g})")
    p.add_argument("--drain-quiet", type=float, default=None,
                   help="after --drain-linger, the API keeps answering (503) until no request has come for "
                        f"this many seconds, within --drain-timeout (default: ${C.ENV_DRAIN_QUIET}, else "
                        f"{C.MASTER_DRAIN_QUIET_S:g})")
    _add_security_flags(p, C.MAX_CONTROL_FRAME_BYTES)
    p.add_argument("--admin-port", type=int, default=C.MASTER_ADMIN_PORT,
                   help="HTTP port of /v1/stages and control RPCs (default: %(default)s)")
    p.add_argument("--api-key-file", help=f"file holding the API key of the inference endpoints "
                                          f"(default: ${C.ENV_API_KEY}; none: no key)")
    p.add_argument("--admin-token-file", help=f"file holding the admin port's token "
                                              f"(default: ${C.ENV_ADMIN_TOKEN}; none: the admin API is off)")
    _heartbeat_flags(p)
    p.add_argument("--log-level", default="info")
    args = p.parse_args(argv)
    setup_logging(args.log_level, "master")
    doc = _load(args.config)
    keys = _keys(args.keys_dir)
    interval, timeout = _heartbeat(doc, args)
    from . import tracing
    from .master import run_master

    tracing.setup("omnifleet-master", os.environ.get(C.ENV_POD_NAME) or socket.gethostname())

    return run_master(
        doc, host=args.host, api_port=args.api_port or doc.spec.master.api_port,
        control_port=args.control_port, replica_wait_s=args.replica_wait_timeout, admin_port=args.admin_port,
        keys=keys, max_frame_bytes=args.max_frame_bytes,
        api_key=_secret(args.api_key_file, C.ENV_API_KEY),
        admin_token=_secret(args.admin_token_file, C.ENV_ADMIN_TOKEN),
        heartbeat_interval_s=interval, heartbeat_timeout_s=timeout, drain_timeout_s=args.drain_timeout,
        drain_linger_s=_seconds(args.drain_linger, C.ENV_DRAIN_LINGER, C.MASTER_DRAIN_LINGER_S),
        drain_quiet_s=_seconds(args.drain_quiet, C.ENV_DRAIN_QUIET, C.MASTER_DRAIN_QUIET_S),
    )


def _secret(path: str | None, env: str) -> str | None:
    """A secret from a file (surrounding whitespace dropped) or else an environment variable; None if empty."""
    if path:
        try:
            with open(path, encoding="utf-8") as f:
                value = f.read().strip()
        except OSError as e:
            sys.exit(f"omnifleet: cannot read {path}: {e}")
        if not value:
            sys.exit(f"omnifleet: {path} is empty")
        return value
    return os.environ.get(env, "").strip() or None


def _default_advertise_host() -> str:
    if os.environ.get(C.ENV_POD_IP):
        return os.environ[C.ENV_POD_IP]
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def stage(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="omnifleet stage",
        description="Run one stage replica (a pod); more --stage flags co-locate stages in it, the first is the host.",
    )
    p.add_argument("--config", default=C.CONFIG_PATH, help="pipeline file (default: %(default)s)")
    p.add_argument("--stage", action="append", required=True, help="stage to run (repeat to co-locate)")
    p.add_argument("--master", required=True,
                   help="HOST:PORT of the masters' control port, comma-separated for several; a HOST that "
                        "resolves to several addresses (a headless Service) names a master at each, "
                        "resolved again every few seconds; the stage registers with every master")
    p.add_argument("--host", default="0.0.0.0", help="address to bind (default: %(default)s)")
    p.add_argument("--data-port", type=int, default=C.STAGE_DATA_PORT,
                   help="data port of the first stage; co-located stages add their index; 0 picks free ports "
                        "(default: %(default)s)")
    p.add_argument("--health-port", type=int, default=C.STAGE_HEALTH_PORT,
                   help="HTTP /livez and /readyz port (default: %(default)s)")
    p.add_argument("--metrics-port", type=int, default=C.STAGE_METRICS_PORT,
                   help="HTTP /metrics port, Prometheus text; 0 serves none (default: %(default)s)")
    p.add_argument("--advertise-host", default=None,
                   help=f"address other stages reach this pod at (default: ${C.ENV_POD_IP}, else this host)")
    p.add_argument("--drain-timeout", type=float, default=C.DRAIN_TIMEOUT_S,
                   help="seconds to finish in-flight work after SIGTERM (default: %(default)s)")
    p.add_argument("--exit-timeout", type=float, default=C.STAGE_EXIT_TIMEOUT_S,
                   help="seconds a stage may take to exit after its drain deadline; past them its threads' "
                        "stacks are logged and it is killed (default: %(default)s)")
    _add_security_flags(p, C.MAX_DATA_FRAME_BYTES)
    _heartbeat_flags(p)
    p.add_argument("--log-level", default="info")
    args = p.parse_args(argv)
    replica = os.environ.get(C.ENV_POD_NAME) or f"{socket.gethostname()}-{os.getpid()}"
    setup_logging(args.log_level, f"pod {replica}")
    doc = _load(args.config)
    names = {s.name for s in doc.spec.stages}
    unknown = [s for s in args.stage if s not in names]
    if unknown:
        sys.exit(f"omnifleet: no stage named {', '.join(unknown)} in {args.config} (stages: {', '.join(sorted(names))})")
    if len(set(args.stage)) != len(args.stage):
        sys.exit("omnifleet: a stage is named more than once")
    interval, timeout = _heartbeat(doc, args)
    from .discovery import BadMasterList, parse_masters

    try:
        parse_masters(args.master)
    except BadMasterList as e:
        sys.exit(f"omnifleet: --master: {e}")
    from .pod import Pod, WorkerSpec
    from .security import keys_dir

    _keys(args.keys_dir)  # a missing or bad key fails the pod at once, with the file named
    advertise = args.advertise_host or _default_advertise_host()
    workers = [
        WorkerSpec(
            config_path=args.config, stage=name, replica=replica, masters=args.master,
            host=args.host, data_port=args.data_port + i if args.data_port else 0, advertise_host=advertise,
            drain_timeout_s=args.drain_timeout, log_level=args.log_level,
            keys_dir=keys_dir(args.keys_dir), max_frame_bytes=args.max_frame_bytes,
            heartbeat_interval_s=interval, heartbeat_timeout_s=timeout,
        )
        for i, name in enumerate(args.stage)
    ]
    return asyncio.run(Pod(workers, args.host, args.health_port, args.metrics_port, args.exit_timeout).run())
