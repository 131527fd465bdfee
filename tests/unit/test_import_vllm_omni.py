"""`omnifleet import vllm-omni`: every deploy file of the vLLM-Omni wheel converts or is refused.

The wheel is real data: downloaded without its dependencies into the cache
(`omnifleet_operator.vllm_omni.wheel`) and read as a zip; nothing imports
vLLM-Omni. A machine that cannot get the wheel fails these tests.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from omnifleet_operator.checks import check_document
from omnifleet_operator.render import desired
from omnifleet_operator.vllm_omni import topology
from omnifleet_operator.vllm_omni.importer import DEFAULT_VERSION, import_deploy, load_topologies
from omnifleet_operator.vllm_omni.wheel import ensure_unpacked, ensure_wheel

from ..conftest import REPO, time_limit

TEST_TIMEOUT_S = 300  # the first run downloads the 8 MB wheel
# The counts the README quotes, for vLLM-Omni 0.30.0's bundled deploy files.
EXPECTED = {"files": 110, "converted": 93, "refused": 17}
# Of the converted, those with async-chunk (streaming) stages; each converts with --no-async-chunk too.
EXPECTED_ASYNC_CHUNK = 42


@pytest.fixture(autouse=True)
def overall_timeout():
    with time_limit(TEST_TIMEOUT_S):
        yield


@pytest.fixture(scope="module")
def deploy_dir() -> Path:
    return ensure_unpacked(DEFAULT_VERSION) / "vllm_omni" / "deploy"


def stages_by_name(doc):
    return {s["name"]: s for s in doc["spec"]["stages"]}


def test_topology_data_is_generated_from_the_wheel():
    data = topology.extract(ensure_wheel(DEFAULT_VERSION))
    assert data["notEvaluated"] == {}
    assert topology.data_path(DEFAULT_VERSION).read_text() == topology.render(data), (
        "pipelines-0.30.0.yaml is stale: run python -m omnifleet_operator.vllm_omni.topology WHEEL")
    assert "qwen2_5_omni" in data["pipelines"] and len(data["pipelines"]) >= 60
    # The README says no pipeline of this registry has a stage with several upstream stages (fan-in).
    assert max(len(s.get("input_sources") or ()) for p in data["pipelines"].values() for s in p["stages"]) == 1


def test_every_bundled_deploy_file_converts_or_is_refused_with_a_reason(deploy_dir):
    files = sorted(deploy_dir.glob("*.yaml"))
    data = load_topologies()
    converted, refused, streaming = [], [], []
    for f in files:
        r = import_deploy(f)
        if r.document is None:
            assert r.refusals and all(isinstance(x, str) and x for x in r.refusals), f.name
            refused.append(f.name)
            continue
        assert r.refusals == [], f.name
        parsed, problems = check_document(r.document)
        assert problems == [], (f.name, problems)
        objs = desired(parsed)
        topo = data["pipelines"][r.pipeline]
        assert len(parsed.spec.stages) == len(topo["stages"]), f.name
        assert all(s.type == "vllm-omni" for s in parsed.spec.stages)
        deployments = [o for o in objs if o["kind"] == "Deployment"]
        assert len(deployments) == 1 + len(parsed.spec.hosts()), f.name
        converted.append(f.name)
        if any(s.vllm_omni.async_chunk for s in parsed.spec.stages):
            streaming.append(f.name)
            whole = import_deploy(f, async_chunk=False)
            assert whole.document is not None, (f.name, whole.refusals)
            parsed, problems = check_document(whole.document)
            assert problems == [] and not any(s.vllm_omni.async_chunk for s in parsed.spec.stages), f.name
            assert all(s.input_mode == "whole" for s in parsed.spec.stages if s.inputs), f.name
    print(f"vLLM-Omni {DEFAULT_VERSION}: {len(files)} deploy files, {len(converted)} converted, "
          f"{len(refused)} refused: {', '.join(refused)}; {len(streaming)} stream in async-chunk mode")
    assert {"files": len(files), "converted": len(converted), "refused": len(refused)} == EXPECTED
    assert len(streaming) == EXPECTED_ASYNC_CHUNK
    readme = " ".join((REPO / "README.md").read_text().split())
    assert f"{EXPECTED_ASYNC_CHUNK} of the {EXPECTED['converted']} stream in async-chunk mode" in readme
    assert (f"{EXPECTED['files']} deploy files of vLLM-Omni {DEFAULT_VERSION}, {EXPECTED['converted']} convert "
            f"and {EXPECTED['refused']} are refused") in readme


def test_qwen2_5_omni_maps_stages_devices_and_sampling(deploy_dir):
    r = import_deploy(deploy_dir / "qwen2_5_omni.yaml", model="/models/Qwen2.5-Omni-7B")
    s = stages_by_name(r.document)
    assert list(s) == ["thinker", "talker", "code2wav"]
    # thinker on GPU 0 (0.8), talker on GPU 1, code2wav shares GPU 0 (0.15): two pod groups.
    assert (s["thinker"]["gpus"], s["thinker"]["replicas"]) == (1, 1)
    assert s["code2wav"]["colocateWith"] == "thinker" and "gpus" not in s["code2wav"]
    assert s["talker"]["gpus"] == 1 and "colocateWith" not in s["talker"]
    assert s["talker"]["inputs"] == ["thinker"] and s["talker"]["inputMode"] == "whole"
    assert s["code2wav"]["finalOutput"] == "audio" and s["thinker"]["finalOutput"] == "text"
    assert s["talker"]["vllmOmni"]["inputProcessor"] == \
        "vllm_omni.model_executor.stage_input_processors.qwen2_5_omni.thinker2talker_token_only"
    assert s["code2wav"]["vllmOmni"]["workerType"] == "generation"
    # Sampling defaults with the topology's constraints merged in (the talker's repetition penalty, its stop id).
    assert s["talker"]["samplingParams"]["repetition_penalty"] == 1.05
    assert s["talker"]["samplingParams"]["stop_token_ids"] == [8294]
    assert s["code2wav"]["engineArgs"]["gpu_memory_utilization"] == 0.15
    assert s["code2wav"]["engineArgs"]["enable_flashinfer_autotune"] is False
    assert r.document["spec"]["model"] == "/models/Qwen2.5-Omni-7B"
    assert any("platforms.npu" in w for w in r.warnings)


def test_qwen3_omni_streams_and_colocates_by_device(deploy_dir):
    r = import_deploy(deploy_dir / "qwen3_omni_moe.yaml")
    s = stages_by_name(r.document)
    assert s["talker"]["inputMode"] == "stream" and s["code2wav"]["inputMode"] == "stream"
    assert s["code2wav"]["colocateWith"] == "talker"
    assert s["talker"]["vllmOmni"]["asyncChunk"] is True
    # CUDA's platform overlay is applied, the others are not.
    assert s["thinker"]["engineArgs"]["compilation_config"] == {"custom_ops": ["+rotary_embedding"]}
    assert "tensor_parallel_size" not in s["thinker"]["engineArgs"]
    assert s["talker"]["vllmOmni"]["stageConfig"]["connectors"]["connector_of_shared_memory"]["extra"][
        "codec_chunk_frames"] == 25
    assert any("resolve_qwen3_omni_pipeline" in w for w in r.warnings)
    # The stages run in async-chunk mode as imported: nothing to warn about.
    assert not any("async" in w for w in r.warnings), r.warnings


def test_bagel_converts_with_a_warning_for_each_stage_of_its_kv_cache_hand_over(deploy_dir):
    # The thinker's KV caches (and its CFG companions') reach the DiT through vLLM-Omni's connector, not as a
    # stage output: omnifleet's wire does not carry them, which the import says for both ends.
    r = import_deploy(deploy_dir / "bagel.yaml")
    s = stages_by_name(r.document)
    assert s["dit"]["inputs"] == ["thinker"] and s["dit"]["colocateWith"] == "thinker"
    kv = [w for w in r.warnings if "hands KV caches" in w]
    assert [w.split(":")[0] for w in kv] == ["stage thinker", "stage dit"], r.warnings
    assert "omni_kv_config.need_send_cache" in kv[0]
    assert "omni_kv_config.need_recv_cache, cfg_kv_collect_func" in kv[1]
    # A pipeline without such a hand-over gets no such warning.
    assert not any("hands KV caches" in w for w in import_deploy(deploy_dir / "qwen2_5_omni.yaml").warnings)


def test_no_async_chunk_imports_the_whole_output_mode(deploy_dir, tmp_path):
    # vLLM-Omni's --no-async-chunk: the sync processors replace the async-chunk ones, edges hand over whole outputs.
    r = import_deploy(deploy_dir / "qwen3_omni_moe.yaml", async_chunk=False)
    s = stages_by_name(r.document)
    assert s["talker"]["inputMode"] == "whole" and s["code2wav"]["inputMode"] == "whole"
    assert not any("asyncChunk" in st["vllmOmni"] for st in s.values())
    assert s["talker"]["vllmOmni"]["inputProcessor"] == \
        "vllm_omni.model_executor.stage_input_processors.qwen3_omni.thinker2talker_token_only"
    assert s["talker"]["engineArgs"]["async_chunk"] is False
    assert not any("async-chunk mode" in w for w in r.warnings), r.warnings
    # --async-chunk on a pipeline without async-chunk processors: refused by vLLM-Omni's own rule.
    on = import_deploy(deploy_dir / "qwen2_5_omni.yaml", async_chunk=True)
    assert on.document is None
    assert any("no stage declares an async-chunk next-stage processor" in x for x in on.refusals), on.refusals


def test_base_config_chain_is_merged_by_vllm_omnis_rules(deploy_dir, tmp_path):
    base = tmp_path / "base.yaml"
    base.write_text((deploy_dir / "qwen2_5_omni.yaml").read_text())
    mid = tmp_path / "mid.yaml"
    mid.write_text("base_config: base.yaml\nstages:\n  - stage_id: 1\n    default_sampling_params: {temperature: 0.5}\n")
    top = tmp_path / "top.yaml"
    top.write_text("base_config: mid.yaml\nstages:\n  - stage_id: 2\n    max_num_seqs: 4\n    devices: '1'\n"
                   "  - stage_id: 7\n    max_num_seqs: 1\n")
    r = import_deploy(top, pipeline="qwen2_5_omni", name="merged")
    assert r.refusals == []
    s = stages_by_name(r.document)
    # Deep-merged sampling: the overlay's temperature, the base's other fields.
    assert s["talker"]["samplingParams"]["temperature"] == 0.5
    assert s["talker"]["samplingParams"]["top_k"] == 40
    assert s["code2wav"]["engineArgs"]["max_num_seqs"] == 4
    assert s["code2wav"]["engineArgs"]["gpu_memory_utilization"] == 0.15  # kept from the base
    assert s["code2wav"]["colocateWith"] == "talker"  # moved to GPU 1 by the overlay
    assert any("stage_id 7" in w for w in r.warnings)


@pytest.mark.parametrize("overlay,fragment", [
    ("stages:\n  - stage_id: 2\n    gpu_memory_utilization: 0.3\n",
     "GPU 0: gpu_memory_utilization of thinker 0.8 + code2wav 0.3 = 1.10 > 1.0"),
    ("stages:\n  - stage_id: 2\n    num_replicas: 2\n    devices: '0,2'\n",
     "share a GPU (GPU 0) but ask for 1 replica(s) of thinker, 2 replica(s) of code2wav"),
    ("stages:\n  - stage_id: 1\n    num_replicas: 2\n    devices: '1,2,3'\n",
     "devices='1,2,3' has 3 id(s); vLLM-Omni needs 1 (per-replica template) or 2 (pool)"),
    ("stages:\n  - stage_id: 1\n    kv_transfer_config: {kv_connector: MooncakeConnector, kv_ip: 127.0.0.1}\n",
     "kv_transfer_config.kv_ip = '127.0.0.1' assumes its peer stages on the same host"),
    ("session_mode: duplex\n", "session_mode: duplex"),
    ("async_chunk: true\n", "no stage declares an async-chunk next-stage processor"),
    ("stage_args: []\n", "removed `stage_args` schema"),
    ("model_runner: v3\n", "model_runner must be one of"),
])
def test_refusals_name_the_reason(deploy_dir, tmp_path, overlay, fragment):
    (tmp_path / "qwen2_5_omni.yaml").write_text((deploy_dir / "qwen2_5_omni.yaml").read_text())
    f = tmp_path / "variant.yaml"
    f.write_text("base_config: qwen2_5_omni.yaml\n" + overlay)
    r = import_deploy(f)
    assert r.document is None
    assert any(fragment in x for x in r.refusals), r.refusals


def test_bad_files_are_refused(tmp_path):
    loop_a, loop_b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    loop_a.write_text("base_config: b.yaml\n")
    loop_b.write_text("base_config: a.yaml\n")
    assert "base_config chain loops" in import_deploy(loop_a).refusals[0]
    missing = tmp_path / "m.yaml"
    missing.write_text("base_config: nowhere.yaml\nstages: []\n")
    assert "base_config nowhere.yaml not found" in import_deploy(missing).refusals[0]
    broken = tmp_path / "broken.yaml"
    broken.write_text("stages: [unclosed\n")
    assert "cannot read it as YAML" in import_deploy(broken).refusals[0]
    nameless = tmp_path / "mystery_model.yaml"
    nameless.write_text("stages:\n  - stage_id: 0\n    max_num_seqs: 1\n")
    assert "pass --pipeline NAME" in import_deploy(nameless).refusals[0]
    assert "is not registered" in import_deploy(nameless, pipeline="no_such_pipeline").refusals[0]


def omnifleet(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "omnifleet_operator.cli", *args], input=stdin,
                          capture_output=True, text=True, cwd=REPO, timeout=60)


def test_cli_prints_a_pipeline_that_validates(deploy_dir):
    r = omnifleet("import", "vllm-omni", str(deploy_dir / "bagel.yaml"), "--name", "bagel", "--model", "/models/b")
    assert r.returncode == 0, r.stderr
    doc = yaml.safe_load(r.stdout)
    assert doc["metadata"]["name"] == "bagel" and doc["spec"]["model"] == "/models/b"
    assert "warning: connectors.rdma_connector: MooncakeTransferEngineConnector" in r.stderr
    v = omnifleet("validate", "-f", "-", stdin=r.stdout)
    assert v.returncode == 0 and "valid: pipeline 'bagel'" in v.stdout, v.stderr
    r = omnifleet("import", "vllm-omni", str(deploy_dir / "qwen3_omni_moe.yaml"), "--no-async-chunk")
    assert r.returncode == 0 and "async-chunk mode" not in r.stderr, r.stderr
    assert all(s.get("inputMode", "whole") == "whole" for s in yaml.safe_load(r.stdout)["spec"]["stages"])


def test_cli_refuses_with_one_line_per_reason(deploy_dir):
    r = omnifleet("import", "vllm-omni", str(deploy_dir / "hunyuan-image-3-mooncakeconnector.yaml"))
    assert r.returncode == 1 and r.stdout == ""
    refusals = [line for line in r.stderr.splitlines() if line.startswith("refused: ")]
    assert refusals == ["refused: stage ar: engine_args.kv_transfer_config.kv_ip = '127.0.0.1' assumes its peer "
                        "stages on the same host, but the pipeline runs in 2 pod groups"]
    r = omnifleet("import", "vllm-omni", str(deploy_dir / "qwen2_5_omni.yaml"), "--async-chunk")
    assert r.returncode == 1 and "no stage declares an async-chunk next-stage processor" in r.stderr
    r = omnifleet("import", "vllm-omni", "/nonexistent/deploy.yaml")
    assert r.returncode == 2 and "no such file" in r.stderr


def test_gpus_per_replica_follow_the_parallel_sizes(deploy_dir):
    s = stages_by_name(import_deploy(deploy_dir / "hunyuan_image_3_moe.yaml").document)
    # ar: tensor_parallel_size 2 on devices 0,1; dit: a diffusion parallel_config with tensor_parallel_size 2 on 2,3
    assert (s["ar"]["gpus"], s["dit"]["gpus"]) == (2, 2)
    assert s["dit"]["vllmOmni"]["workerType"] == "diffusion" and "colocateWith" not in s["dit"]
    s = stages_by_name(import_deploy(deploy_dir / "minimax_h3_disaggregated.yaml").document)
    assert (s["encoder"]["gpus"], s["dit"]["gpus"]) == (2, 4)
