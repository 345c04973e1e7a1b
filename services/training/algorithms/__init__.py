"""The RL algorithm registry, shared by every trainer backend (torch, megatron).

Contract between a backend and an algorithm
-------------------------------------------
The backend owns the model: forward, backward, optimizer, scheduler. The algorithm owns
the maths: which samples are trained and in which minibatches, advantages, the loss.
One ``train_step(samples)`` of a backend whose weights are version ``v`` does::

    algo = make_algorithm(acfg.algorithm)                  # once, at start
    plan = algo.prepare(samples, v)                        # rows, advantages [N] (or [N, T]), stale [N], minibatches
    if not plan.samples: nothing to train (e.g. DPO with no pair): no optimizer step
    prox = no-grad logprobs of every minibatch   if algo.needs_prox(plan)   (before the first update)
    ref  = logprobs under the frozen reference   if algo.needs_reference    (KL add-on, DPO)
    for epoch in range(cfg.epochs):
        for mb in plan.minibatches:                        # row indices into plan.samples
            logp [B,T] (with grad), entropy [B,T] (with grad if algo.needs_entropy_grad; optional otherwise)
            x = make_inputs(cfg, logp, rollout_logp, mask, plan.advantages_for(mb, T), plan.stale[mb],
                            prox[mb], ref[mb], entropy)    # TIS is applied here
            loss, stats = algo.loss(x); loss.backward(); clip grads; optimizer.step(); scheduler.step()

Tensors are per target token (already shifted by one: position t holds the logprob of
token t+1 given tokens ≤ t), right-padded, ``mask`` = the sample's ``loss_mask`` shifted
the same way; ``rollout_logp`` = the sample's ``rollout_logprobs`` shifted alike. Logprobs
are taken at the sampling temperature (``token_logprobs`` in ``services.training.grpo``); a
backend may leave logp, entropy, prox and ref 0 off the mask (the torch backend takes the
logits at the masked positions alone), so a loss reads them under the mask only.
Under ``trainer.micro_batch_size`` a minibatch's rows run a few at a time (``micro.py``):
``x.share`` scales each term by the micro-batch's share of what the term is a mean over,
which an algorithm declares (``policy_mean``: tokens or rows; ``row_stats``, ``sum_stats``).
``stats`` is a flat dict of floats (``pg_loss``, ``loss``, ``kl``/``kl_loss``,
``entropy``/``entropy_loss``, ``clip_frac``, TIS statistics ...); the backend averages
them over minibatches and adds ``grad_norm``, ``lr``, ``tokens_per_s`` for the
``train_step`` event.

Algorithms: ``grpo``, ``dr_grpo``, ``ppo``, ``gspo``, ``cispo``, ``reinforce_pp``,
``reinforce_pp_baseline``, ``sft``, ``dpo``; add-ons on any of them: KL to the frozen
start weights (``kl_coef``, ``kl_estimator`` k1/k2/k3), entropy bonus (``entropy_coef``),
TIS (``tis``, ``tis_cap``) for samples older than the trainer's weights. A plug-in is
named ``package.module:Class`` (a subclass of ``Algorithm``).
"""

from __future__ import annotations

import importlib
from typing import Any

from services.contracts.config import BUILTIN_ALGORITHMS, AlgorithmConfig
from services.training.algorithms.base import (
    Algorithm,
    LossInputs,
    Share,
    Stats,
    StepPlan,
    kl_estimate,
    make_inputs,
    masked_mean,
)
from services.training.algorithms.policy_gradient import (
    CISPO,
    GRPO,
    GSPO,
    PPO,
    DrGRPO,
    ReinforcePP,
    ReinforcePPBaseline,
)
from services.training.algorithms.supervised import DPO, SFT

ALGORITHMS: dict[str, type[Algorithm]] = {
    cls.name: cls for cls in (GRPO, DrGRPO, PPO, GSPO, CISPO, ReinforcePP, ReinforcePPBaseline, SFT, DPO)
}
assert tuple(ALGORITHMS) == BUILTIN_ALGORITHMS, "contracts.config.BUILTIN_ALGORITHMS must list the registry"


def load_algorithm_class(name: str) -> type[Algorithm]:
    """A built-in name or ``package.module:Class``; a clear ValueError naming the choices otherwise."""
    if name in ALGORITHMS:
        return ALGORITHMS[name]
    if ":" not in name:
        raise ValueError(f"algorithm.name: unknown algorithm {name!r}; available: {', '.join(ALGORITHMS)} "
                         "or a plug-in package.module:Class")
    module_name, _, attr = name.partition(":")
    try:
        obj = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"algorithm.name: cannot load plug-in {name!r}: {exc}") from None
    if not (isinstance(obj, type) and issubclass(obj, Algorithm)):
        raise ValueError(f"algorithm.name: {name!r} is not a subclass of services.training.algorithms.Algorithm")
    return obj


def make_algorithm(cfg: AlgorithmConfig) -> Algorithm:
    return load_algorithm_class(cfg.name)(cfg)


def mean_stats(parts: list[Stats]) -> Stats:
    """Average each stat over the minibatches that reported it (maxima stay maxima)."""
    keys = {k for p in parts for k in p}
    out: Stats = {}
    for k in sorted(keys):
        vals = [p[k] for p in parts if k in p]
        out[k] = max(vals) if k.endswith("_max") else (min(vals) if k.endswith("_min") else sum(vals) / len(vals))
    return out


def step_metrics(parts: list[Stats], samples: list[Any], plan: StepPlan, cfg: AlgorithmConfig, backend: str,
                 lr: float, grad_norms: list[float], elapsed: float) -> dict[str, Any]:
    """The ``train_step`` metrics every backend reports for one batch (same keys whatever the backend)."""
    tokens = sum(len(s.tokens) for s in plan.samples) * cfg.epochs
    out: dict[str, Any] = {**mean_stats(parts), "algorithm": cfg.name, "backend": backend,
                           "reward_mean": sum(s.reward for s in samples) / max(len(samples), 1),
                           "samples": len(samples), "samples_trained": len(plan.samples),
                           "optimizer_steps": len(parts), "lr": lr, "tokens": tokens, "train_seconds": elapsed,
                           "tokens_per_s": tokens / max(elapsed, 1e-9)}
    out.setdefault("pg_loss", 0.0)
    out.setdefault("clip_frac", 0.0)
    if grad_norms:
        out.update(grad_norm=max(grad_norms), grad_norm_mean=sum(grad_norms) / len(grad_norms))
    return out


__all__ = ["ALGORITHMS", "Algorithm", "LossInputs", "Share", "Stats", "StepPlan", "kl_estimate", "load_algorithm_class",
           "make_algorithm", "make_inputs", "masked_mean", "mean_stats", "step_metrics"]
