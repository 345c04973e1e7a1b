# The trainer role on GPUs: the official PyTorch CUDA image plus megatron-core and Tandem.
# Runs `python -m services.trainer` (one GPU), or under `torchrun` across GPUs and nodes.
FROM pytorch/pytorch:2.11.0-cuda12.8-cudnn9-runtime

ARG MEGATRON_CORE_VERSION=0.19.2
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
    HF_HUB_DISABLE_PROGRESS_BARS=1 TOKENIZERS_PARALLELISM=false TANDEM_HEALTH_PORT=8080

RUN useradd --create-home --uid 10001 tandem
WORKDIR /app
COPY pyproject.toml constraints.txt README.md deploy/install-tandem.sh ./
COPY services ./services
RUN pip install --no-cache-dir "megatron-core==${MEGATRON_CORE_VERSION}" && sh install-tandem.sh \
    && python -c "import megatron.core, torch.distributed.run" \
    && mkdir -p /models /checkpoints /runs && chown tandem /models /checkpoints /runs
USER tandem
EXPOSE 8080 29500
HEALTHCHECK --interval=15s --timeout=5s --start-period=300s --retries=5 CMD ["python", "-m", "services.common.health"]
CMD ["python", "-m", "services.trainer", "--help"]
