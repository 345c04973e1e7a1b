"""The megatron-core trainer backend: GPTModel from an HF config, HF <-> Megatron weights, the policy.

``model`` builds the GPTModel (dense Qwen2, Qwen3, Llama) and starts the parallel state;
``weights`` converts HF safetensors to megatron's fused layouts and back; ``policy`` is
``MegatronPolicy``; ``layout`` validates the parallel layout; ``cpu_compat`` is the small
device-compatibility layer used only on machines without a GPU.
"""

import logging
import warnings

# megatron-core announces at import that it falls back from apex / Transformer Engine to its local
# implementations; that is the intended setup here (local layer spec), so keep the service log quiet.
warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex) (and Apex )?(is|are) not installed")
logging.getLogger("megatron.core").setLevel(logging.WARNING)

from services.training.megatron.policy import MegatronPolicy  # noqa: E402

__all__ = ["MegatronPolicy"]
