"""Checks a megatron parallel layout against the model and the launch, before anything is built.

A bad layout fails at start with a ``ConfigError`` that names the agent's field
(``megatron.tensor_parallel`` ...) and says what would make it valid.
"""

from __future__ import annotations

from services.contracts.config import ConfigError, MegatronLayout
from services.training.megatron.model import Arch


def check_layout(lay: MegatronLayout, arch: Arch, world_size: int, gpus: bool) -> None:
    tp, pp, dp = lay.tensor_parallel, lay.pipeline_parallel, lay.data_parallel
    if (tp > 1 or pp > 1) and not gpus:
        field = "megatron.tensor_parallel" if tp > 1 else "megatron.pipeline_parallel"
        raise ConfigError(f"{field}: tensor/pipeline parallelism needs GPUs and none is present; "
                          "on a CPU use tensor_parallel: 1 and pipeline_parallel: 1")
    if arch.num_heads % tp or arch.num_kv_heads % tp:
        raise ConfigError(f"megatron.tensor_parallel: {tp} must divide the attention heads ({arch.num_heads}) "
                          f"and the key/value heads ({arch.num_kv_heads})")
    if arch.ffn % tp or arch.vocab % tp:
        raise ConfigError(f"megatron.tensor_parallel: {tp} must divide intermediate_size ({arch.ffn}) "
                          f"and vocab_size ({arch.vocab})")
    if arch.num_layers % pp:
        raise ConfigError(f"megatron.pipeline_parallel: {pp} must divide the number of layers ({arch.num_layers})")
    if tp * pp * dp != world_size:
        raise ConfigError(f"megatron.data_parallel: tensor_parallel x pipeline_parallel x data_parallel = "
                          f"{tp}x{pp}x{dp} = {tp * pp * dp}, but the trainer runs "
                          f"{world_size} process(es) (WORLD_SIZE); "
                          f"start it with torchrun --nproc_per_node {tp * pp * dp} or fix data_parallel")
