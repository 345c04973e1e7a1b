"""Training library: the policy backends (torch, megatron-core), the RL algorithm registry, LoRA.

Any service may use it (the trainer service, the Tinker API service); it has no ``__main__``.
"""
