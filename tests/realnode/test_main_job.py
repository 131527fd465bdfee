"""`make run`'s main job on the suite's cluster: the tiny vLLM pipeline goes Ready on real pods and
one request is answered through the master Service. It reuses the running cluster (`dev up` twice is
harmless) and leaves it running (`--keep-running`); its namespace is deleted afterwards."""

from __future__ import annotations

import subprocess
import sys

from .conftest import REPO


def test_main_job_serves_the_tiny_pipeline_from_the_operators_pods(cluster):
    ns = "rn-main-job"
    try:
        r = subprocess.run([sys.executable, "-m", "omnifleet_operator.main", "--state-dir", str(cluster.state_dir),
                            "--namespace", ns, "--exit-when-ready", "--keep-running", "--timeout", "420"],
                           capture_output=True, text=True, cwd=REPO, timeout=560)
        out = r.stdout + r.stderr
        assert r.returncode == 0, out
        for needle in ("tiny-vllm.yaml: pipeline 'tiny-vllm'", "cluster already running",
                       "operator running in the cluster", "phase=Ready ready=2/2",
                       "one request through the master Service answered", "kubectl port-forward -n rn-main-job",
                       "from openai import OpenAI"):
            assert needle in out, out
        assert "invalid" not in out, out
        # Only the python-code sample's own module (it ships in a ConfigMap) cannot be imported here.
        unchecked = [line for line in out.splitlines() if "not checked" in line]
        assert len(unchecked) == 2 and all("textops:" in line for line in unchecked), unchecked
    finally:
        cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)
