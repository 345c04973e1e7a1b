# The rollout role on GPUs: the official SGLang image (SGLang server, CUDA torch) plus Tandem.
# `python -m services.rollout` starts the agent's SGLang router and `num_engines`
# `sglang.launch_server` children on the GPUs this container is given.
FROM lmsysorg/sglang:v0.5.18-cu130

ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_BREAK_SYSTEM_PACKAGES=1 HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_PROGRESS_BARS=1 TOKENIZERS_PARALLELISM=false TANDEM_HEALTH_PORT=8080

RUN (command -v python >/dev/null || ln -s "$(command -v python3)" /usr/local/bin/python) \
    && useradd --create-home --uid 10001 tandem
WORKDIR /app
COPY pyproject.toml constraints.txt README.md deploy/install-tandem.sh ./
COPY services ./services
RUN sh install-tandem.sh && python -c "import sglang" \
    && mkdir -p /models /checkpoints /runs && chown tandem /models /checkpoints /runs
USER tandem
EXPOSE 8080
# SGLang servers load the model and capture CUDA graphs: a long start period
HEALTHCHECK --interval=20s --timeout=5s --start-period=900s --retries=5 CMD ["python", "-m", "services.common.health"]
CMD ["python", "-m", "services.rollout", "--help"]
