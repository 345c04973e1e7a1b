"""Tinker's built-in losses on one datum: cross_entropy, importance_sampling, ppo, cispo, dro and gspo.

(``custom``, a loss the session uploaded, is ``custom_loss.py``'s.)

Every loss is a SUM over the datum's tokens (Tinker's definition; the batch loss sums the
datums), and each datum's ``loss_fn_inputs`` align with its ``model_input``: position i
predicts ``target_tokens[i]``. PPO and CISPO reuse the algorithm registry's loss code
(``services.training.algorithms``): every token is laid out as a row of one, so the
registry's per-row advantage is Tinker's per-token advantage, and the clip thresholds
(absolute in Tinker: 0.8 / 1.2) become the registry's epsilons (0.2 / 0.2). DRO and GSPO
follow Tinker's published definitions (tinker-docs.thinkingmachines.ai/tinker/losses/dro and
/gspo): DRO is ``-sum(lp * A - beta / 2 * (lp - q)^2)`` (``beta`` must be given: its default is
not published); GSPO-token gives every token the sequence ratio ``exp(mean over
sequence_ratio_mask of (lp - q))`` (all tokens when the mask is absent) with its own
log-probability's gradient, clipped as PPO clips. ``stable_reinforce`` is refused by name: Tinker
publishes neither its objective nor the sampling-time records (``record_stability_info``) it reads.
"""

from __future__ import annotations

import math

import torch

from services.contracts.config import AlgorithmConfig
from services.training.algorithms.base import LossInputs
from services.training.algorithms.policy_gradient import CISPO, ppo_token_losses

LOSS_INPUTS: dict[str, tuple[str, ...]] = {
    "cross_entropy": ("target_tokens", "weights"),
    "importance_sampling": ("target_tokens", "logprobs", "advantages"),
    "ppo": ("target_tokens", "logprobs", "advantages"),
    "cispo": ("target_tokens", "logprobs", "advantages"),
    "dro": ("target_tokens", "logprobs", "advantages"),
    "gspo": ("target_tokens", "logprobs", "advantages"),
}
OPTIONAL_INPUTS = {"gspo": ("sequence_ratio_mask",)}
CLIP_DEFAULTS = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
CLIPPED = ("ppo", "cispo", "gspo")
REFUSED = {"stable_reinforce": "Tinker publishes neither its objective nor the sampler's stability records "
                               "(record_stability_info) it reads"}


class UserError(ValueError):
    """A request the service cannot serve as given; answered with category ``user``."""


class Conflict(UserError):
    """A ``seq_id`` already recorded with a different body: refused, the recorded request stands."""


class BuiltinLoss:
    """One of Tinker's built-in losses with its checked config, as the trainer calls it per datum."""

    def __init__(self, loss_fn: str, config: dict[str, float | str]) -> None:
        self.loss_fn, self.cfg = loss_fn, check_loss(loss_fn, config)

    def check_datum(self, index: int, n_tokens: int, inputs: dict[str, torch.Tensor]) -> None:
        check_inputs(self.loss_fn, n_tokens, inputs, index)

    def __call__(self, logp: torch.Tensor, inputs: dict[str, torch.Tensor]
                 ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return datum_loss(self.loss_fn, logp, inputs, self.cfg), {}

    def metrics(self, per_datum: list[dict[str, torch.Tensor]]) -> dict[str, float]:
        return {}


def check_loss(loss_fn: str, config: dict[str, float | str]) -> dict[str, float]:
    """The loss's numeric config with defaults; a UserError naming the field otherwise."""
    if loss_fn == "custom":
        raise UserError("loss_fn_config.loss_id: a custom loss is named by the loss_id create_custom_loss returned")
    if loss_fn in REFUSED:
        raise UserError(f"loss_fn: {loss_fn!r} is not served by this Tandem server: {REFUSED[loss_fn]}")
    if loss_fn not in LOSS_INPUTS:
        raise UserError(f"loss_fn: {loss_fn!r} is not supported here; use one of {', '.join(LOSS_INPUTS)}")
    allowed = set(CLIP_DEFAULTS) if loss_fn in CLIPPED else {"beta"} if loss_fn == "dro" else set()
    unknown = sorted(set(config) - allowed)
    if unknown:
        raise UserError(f"loss_fn_config: {unknown} are not options of {loss_fn}"
                        + (f" (it takes {sorted(allowed)})" if allowed else " (it takes none)"))
    if loss_fn == "dro" and "beta" not in config:
        raise UserError("loss_fn_config.beta: dro needs it here (e.g. {'beta': 0.05})")
    out: dict[str, float] = {}
    for key in allowed:
        value = config.get(key, CLIP_DEFAULTS.get(key))
        if not isinstance(value, int | float) or not math.isfinite(float(value)):
            raise UserError(f"loss_fn_config.{key}: must be a finite number, got {value!r}")
        out[key] = float(value)
    if loss_fn in CLIPPED and not 0.0 <= out["clip_low_threshold"] < 1.0:
        raise UserError("loss_fn_config.clip_low_threshold: must be in [0, 1)")
    if loss_fn in CLIPPED and not out["clip_high_threshold"] > 1.0:
        raise UserError("loss_fn_config.clip_high_threshold: must be > 1")
    if loss_fn == "dro" and out["beta"] < 0:
        raise UserError("loss_fn_config.beta: must be 0 or more")
    return out


def check_inputs(loss_fn: str, n_tokens: int, inputs: dict[str, torch.Tensor], index: int) -> None:
    """Every input the loss needs is there, aligned with the datum's ``n_tokens`` positions."""
    need = LOSS_INPUTS[loss_fn]
    missing = [k for k in need if k not in inputs]
    if missing:
        raise UserError(f"data[{index}].loss_fn_inputs: {loss_fn} needs {missing}")
    targets = inputs["target_tokens"]
    if targets.dim() not in (1, 2) or targets.shape[0] != n_tokens:
        raise UserError(f"data[{index}].loss_fn_inputs.target_tokens: shape {list(targets.shape)} does not "
                        f"align with model_input's {n_tokens} tokens")
    if loss_fn != "cross_entropy" and targets.dim() != 1:
        raise UserError(f"data[{index}].loss_fn_inputs.target_tokens: {loss_fn} takes one target per position")
    for key in (*need[1:], *(k for k in OPTIONAL_INPUTS.get(loss_fn, ()) if k in inputs)):
        if tuple(inputs[key].shape) != tuple(targets.shape):
            raise UserError(f"data[{index}].loss_fn_inputs.{key}: shape {list(inputs[key].shape)} differs from "
                            f"target_tokens' {list(targets.shape)}")
        if not bool(torch.isfinite(inputs[key]).all()):
            raise UserError(f"data[{index}].loss_fn_inputs.{key}: holds NaN or inf")


def _as_token_rows(logp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor) -> LossInputs:
    n = logp.numel()
    ones = torch.ones((n, 1), dtype=logp.dtype, device=logp.device)
    return LossInputs(logp=logp.reshape(n, 1), old_logp=old.reshape(n, 1).detach(), mask=ones,
                      advantages=adv.reshape(n).to(logp.dtype), tis_weight=ones)


def datum_loss(loss_fn: str, logp: torch.Tensor, inputs: dict[str, torch.Tensor], cfg: dict[str, float]
               ) -> torch.Tensor:
    """The datum's loss (a sum over its tokens); ``logp`` are the target tokens' logprobs, with grad."""
    if loss_fn == "cross_entropy":
        return -(logp * inputs["weights"]).sum()
    old, adv = inputs["logprobs"], inputs["advantages"]
    if loss_fn == "importance_sampling":
        return -(torch.exp(logp - old.detach()) * adv).sum()
    if loss_fn == "dro":
        return -(logp * adv - 0.5 * cfg["beta"] * (logp - old) ** 2).sum()
    if loss_fn == "gspo":
        return gspo_loss(logp, old, adv, inputs.get("sequence_ratio_mask"), cfg)
    low, high = 1.0 - cfg["clip_low_threshold"], cfg["clip_high_threshold"] - 1.0
    x = _as_token_rows(logp, old, adv)
    if loss_fn == "ppo":
        per_token, _ = ppo_token_losses(x, low, high)
        return per_token.sum()
    algo = CISPO(AlgorithmConfig(name="cispo", clip_eps_low=max(low, 1e-12), clip_eps_high=high))
    token_mean, _ = algo.policy_loss(x)  # the registry's token mean over n tokens, back to Tinker's sum
    return token_mean * logp.numel()


def gspo_loss(logp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor | None,
              cfg: dict[str, float]) -> torch.Tensor:
    """GSPO-token: each token's ratio has the sequence ratio's value and its own log-probability's gradient."""
    in_ratio = torch.ones_like(logp, dtype=torch.bool) if mask is None else mask != 0
    if not bool(in_ratio.any()):
        return (logp * 0.0).sum()
    log_ratio = (logp.detach() - old)[in_ratio].mean()
    ratio = torch.exp(log_ratio + logp - logp.detach())
    clipped = ratio.clamp(cfg["clip_low_threshold"], cfg["clip_high_threshold"])
    return -torch.minimum(ratio * adv, clipped * adv).sum()
