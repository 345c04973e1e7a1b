# The rollout role on GPUs: the official SGLang image (SGLang server, CUDA torch) plus Tandem.
# `python -m services.rollout` starts the agent's SGLang router and `num_engines`
# `sglang.launch_server` children on the GPUs this container is given.
# Build arguments: BASE_IMAGE_SGLANG (the base image), PIP_INDEX_URL (a mirror), OFFLINE=1 (install only from
# deploy/wheelhouse: the pins this base lacks, `sh install-tandem.sh --pins` run in it, downloaded with pip).
ARG BASE_IMAGE_SGLANG=lmsysorg/sglang:v0.5.18-cu130
FROM ${BASE_IMAGE_SGLANG}
ARG PIP_INDEX_URL=https://pypi.org/simple
ARG OFFLINE=

ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_BREAK_SYSTEM_PACKAGES=1 HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_PROGRESS_BARS=1 TOKENIZERS_PARALLELISM=false TANDEM_HEALTH_PORT=8080

RUN (command -v python >/dev/null || ln -s "$(command -v python3)" /usr/local/bin/python) \
    && useradd --create-home --uid 10001 tandem
WORKDIR /app
COPY deploy/wheelhouse /wheels
COPY pyproject.toml constraints.txt README.md deploy/install-tandem.sh ./
COPY services ./services
COPY deploy/healthcheck.sh /usr/local/bin/tandem-health
RUN sh install-tandem.sh && python -c "import sglang" \
    && rm -rf /wheels && mkdir -p /models /checkpoints /runs && chown tandem /models /checkpoints /runs
USER tandem
EXPOSE 8080
# SGLang servers load the model and capture CUDA graphs: a long start period
HEALTHCHECK --interval=20s --timeout=5s --start-period=900s --retries=5 CMD ["tandem-health"]
CMD ["python", "-m", "services.rollout", "--help"]
