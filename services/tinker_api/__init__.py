"""The Tinker API service: scripts written for the official Tinker SDK train and sample on Tandem.

``tandem serve [CONFIG] [--port N]`` (or ``python -m services.tinker_api``) serves the SDK's
HTTP protocol with Tandem's training library (LoRA adapters on a shared frozen base, the
algorithm registry's losses) and inference library (the continuous-batching engine).
"""
