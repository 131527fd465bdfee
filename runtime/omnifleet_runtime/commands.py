"""`omnifleet master` and `omnifleet stage`: what the operator renders into pods.

Both read the pipeline file (the mounted ConfigMap by default). Every port
and address flag has a default for Kubernetes (fixed, declared ports) and an
override for local runs and tests.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
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


def master(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="omnifleet master", description="Run the pipeline's master (CPU only).")
    p.add_argument("--config", default=C.CONFIG_PATH, help="pipeline file (default: %(default)s)")
    p.add_argument("--host", default="0.0.0.0", help="address to bind (default: %(default)s)")
    p.add_argument("--api-port", type=int, help="HTTP API port (default: spec.master.apiPort)")
    p.add_argument("--control-port", type=int, default=C.MASTER_CONTROL_PORT,
                   help="ZMQ control port stages connect to (default: %(default)s)")
    p.add_argument("--replica-wait-timeout", type=float, default=C.REPLICA_WAIT_TIMEOUT_S,
                   help="seconds an accepted request waits for a stage with no replica (default: %(default)s)")
    p.add_argument("--log-level", default="info")
    args = p.parse_args(argv)
    setup_logging(args.log_level, "master")
    doc = _load(args.config)
    from .master import run_master

    return run_master(
        doc, host=args.host, api_port=args.api_port or doc.spec.master.api_port,
        control_port=args.control_port, replica_wait_s=args.replica_wait_timeout,
    )


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
    p.add_argument("--master", required=True, help="HOST:PORT of the master's control port")
    p.add_argument("--host", default="0.0.0.0", help="address to bind (default: %(default)s)")
    p.add_argument("--data-port", type=int, default=C.STAGE_DATA_PORT,
                   help="data port of the first stage; co-located stages add their index; 0 picks free ports "
                        "(default: %(default)s)")
    p.add_argument("--health-port", type=int, default=C.STAGE_HEALTH_PORT,
                   help="HTTP /livez and /readyz port (default: %(default)s)")
    p.add_argument("--advertise-host", default=None,
                   help=f"address other stages reach this pod at (default: ${C.ENV_POD_IP}, else this host)")
    p.add_argument("--drain-timeout", type=float, default=C.DRAIN_TIMEOUT_S,
                   help="seconds to finish in-flight work after SIGTERM (default: %(default)s)")
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
    from .pod import Pod, WorkerSpec

    advertise = args.advertise_host or _default_advertise_host()
    workers = [
        WorkerSpec(
            config_path=args.config, stage=name, replica=replica, master_addr=f"tcp://{args.master}",
            host=args.host, data_port=args.data_port + i if args.data_port else 0, advertise_host=advertise,
            drain_timeout_s=args.drain_timeout, log_level=args.log_level,
        )
        for i, name in enumerate(args.stage)
    ]
    return asyncio.run(Pod(workers, args.host, args.health_port).run())
