"""A real Kubernetes control plane (etcd, kube-apiserver, controller-manager,
scheduler, kwok) built from Go modules, for tests and the dev loop.
Stdlib only: importable before any virtualenv extras are installed."""

from .build import BuildError, bin_dir, ensure_binaries
from .cluster import DevCluster, DevClusterError, default_state_dir, kstatus

__all__ = ["BuildError", "DevCluster", "DevClusterError", "bin_dir", "default_state_dir", "ensure_binaries", "kstatus"]
