# The two commands of the README: `make run` and `make test`. Both set up
# everything they need on a fresh machine (a virtualenv at .venv/, and for
# the cluster tests the Kubernetes binaries, built once into ~/.cache/omnifleet).
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | sha256sum | cut -c1-12)

.PHONY: setup run test test-gpu test-unit test-golden-update crd images clean

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[operator,runtime,test,bench]'
	@rm -f $(VENV)/.installed-*; touch $@

setup: $(STAMP)

run: setup
	$(BIN)/python -m omnifleet_operator.main

# --durations: the slowest tests, to tell where a run near its time limit went.
test: setup
	$(BIN)/python -m omnifleet_runtime.devsetup.vllm_cpu
	$(BIN)/python -m omnifleet_runtime.devsetup.vllm_omni_env
	$(BIN)/python -m pytest -q --durations=25

# The repo's images (runtime/Dockerfile, operator/Dockerfile) built with buildah on local bases;
# loaded into the dev node when the dev cluster runs.
images: setup
	$(BIN)/python -m omnifleet_runtime.devsetup.vllm_cpu
	$(BIN)/omnifleet dev images

# The GPU suite (tests/gpu): torch stages on CUDA; on a machine with a GPU, where the default run leaves it out.
test-gpu: setup
	OMNIFLEET_GPU_TESTS=1 $(BIN)/python -m pytest -q tests/gpu

test-unit: setup
	$(BIN)/python -m pytest -q tests/unit tests/golden

test-golden-update: setup
	$(BIN)/python -m pytest -q tests/golden --update-golden

crd: setup
	$(BIN)/omnifleet crd -o crds/omnifleet.dev_omnipipelines.yaml

clean:
	rm -rf $(VENV) .pytest_cache
