# The stage image of `vllm-omni` stages: omnifleet's runtime on top of vLLM-Omni.
#
# vLLM-Omni pins its own vLLM (0.30 for vLLM-Omni 0.30), older than the one
# runtime/Dockerfile builds on, so its stages get an image of their own. Production
# builds FROM vLLM-Omni's official image (CUDA), whose Python already has vLLM,
# vLLM-Omni and torch: `docker build -f runtime/vllm-omni.Dockerfile .` from the repo
# root, then `stages[].image` (or spec.image) names it. Nothing of vLLM-Omni is
# installed here; only omnifleet's runtime goes in. (On CPU, for tests, the stage
# runs with the environment `python -m omnifleet_runtime.devsetup.vllm_omni_env`
# builds, plus the CPU platform plugin in plugins/omnifleet-vllm-omni-cpu.)
ARG BASE=docker.io/vllm/vllm-omni:v0.30.0

FROM ${BASE} AS wheel
ARG PIP_OPTIONS=""
WORKDIR /src
COPY pyproject.toml README.md ./
COPY operator/ operator/
COPY runtime/ runtime/
RUN python3 -m pip wheel --no-cache-dir --no-deps ${PIP_OPTIONS} --wheel-dir /dist .

FROM ${BASE}
ARG PIP_OPTIONS=""
ARG VERSION=0.1.0
ARG REVISION=unknown
LABEL org.opencontainers.image.title="omnifleet-vllm-omni" \
      org.opencontainers.image.description="omnifleet stage pods of vllm-omni stages: vLLM-Omni's own stage engines" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.source="https://github.com/omnifleet/omnifleet" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=wheel /dist/ /tmp/dist/
# Into the Python that has vLLM-Omni; its own pins (vLLM, torch, transformers) stay as they are.
RUN PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install --no-cache-dir ${PIP_OPTIONS} \
        "$(ls /tmp/dist/omnifleet-*.whl)[runtime]" \
    && python3 -c "import vllm_omni, omnifleet_runtime.engines.vllm_omni" \
    && rm -rf /tmp/dist
# The root filesystem is read-only in the pods: caches go to the /tmp emptyDir the operator mounts.
ENV HOME=/tmp XDG_CACHE_HOME=/tmp/.cache PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
RUN getent passwd 1000 >/dev/null || useradd --uid 1000 --user-group --no-create-home --home-dir /tmp omnifleet
USER 1000:1000
ENTRYPOINT ["omnifleet"]
