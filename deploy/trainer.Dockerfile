# The trainer role on GPUs: the official PyTorch CUDA image plus megatron-core and Tandem.
# Runs `python -m services.trainer` (one GPU), or under `torchrun` across GPUs and nodes.
# Build arguments: BASE_IMAGE_PYTORCH (the base image), PIP_INDEX_URL (a mirror), OFFLINE=1 (install only from
# deploy/wheelhouse: the pins this base lacks, `sh install-tandem.sh --pins` run in it, downloaded with pip).
ARG BASE_IMAGE_PYTORCH=pytorch/pytorch:2.11.0-cuda12.8-cudnn9-runtime@sha256:eee11b3b3872a8c838e35ef48f08b2d5def2080902c7f666831310ca1a0ef2be
FROM ${BASE_IMAGE_PYTORCH}
ARG PIP_INDEX_URL=https://pypi.org/simple
ARG OFFLINE=

# The megatron-core the backend is written and tested against (constraints.txt pins the same).
ARG MEGATRON_CORE_VERSION=0.16.1
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
    HF_HUB_DISABLE_PROGRESS_BARS=1 TOKENIZERS_PARALLELISM=false TANDEM_HEALTH_PORT=8080

RUN useradd --create-home --uid 10001 tandem
WORKDIR /app
COPY deploy/wheelhouse /wheels
COPY pyproject.toml constraints.txt README.md deploy/install-tandem.sh ./
COPY services ./services
COPY deploy/healthcheck.sh /usr/local/bin/tandem-health
RUN pip install --no-cache-dir --find-links /wheels ${OFFLINE:+--no-index} "megatron-core==${MEGATRON_CORE_VERSION}" && sh install-tandem.sh \
    && python -c "import megatron.core, torch.distributed.run" \
    && rm -rf /wheels && mkdir -p /models /checkpoints /runs && chown tandem /models /checkpoints /runs
USER tandem
EXPOSE 8080 29500
HEALTHCHECK --interval=15s --timeout=5s --start-period=300s --retries=5 CMD ["tandem-health"]
CMD ["python", "-m", "services.trainer", "--help"]
