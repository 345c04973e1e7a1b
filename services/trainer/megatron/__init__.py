"""The megatron-core trainer backend: GPTModel from an HF config, HF <-> Megatron weights, the policy.

``model`` builds the GPTModel (dense Qwen2, Qwen3, Llama) and starts the parallel state;
``weights`` converts HF safetensors to megatron's fused layouts and back; ``policy`` is
``MegatronPolicy``; ``layout`` validates the parallel layout; ``cpu_compat`` is the small
device-compatibility layer used only on machines without a GPU.
"""

from services.trainer.megatron.policy import MegatronPolicy

__all__ = ["MegatronPolicy"]
