"""The training step every backend runs, written once (the algorithm contract in ``services.training.algorithms``).

``TrainingStep.train_step`` plans the step with the algorithm, pads each minibatch, takes the
no-grad proximal and reference logprobs the algorithm asks for (under ``algorithm.baseline: value``
also the turn states' hidden states, and re-baselines the plan's advantages: value.py), then per epoch
and minibatch:
zero the grads, forward + loss + backward (``backward``; under bf16 autocast when ``precision``
says so) of the whole minibatch, or under ``micro_batch_size`` of each micro-batch of that many of its rows,
each loss scaled by its share so the gradients add up to the minibatch's (algorithms/micro.py; the no-grad
passes run in the same micro-batches), clip (``clip_grads``), step the
optimizer and the LR scheduler; it counts the version up and returns the ``train_step``
metrics, with the step's activation, gradient and optimizer-state memory (memory.py). A backend supplies
the model-specific parts as the hooks below.

A step whose loss, gradient norm or updated weights are non-finite raises ``NonFiniteStep`` before
the version is counted up; the optimizer may have stepped on earlier minibatches, so the caller
restores the last committed training state (the trainer service does) and publishes nothing.
"""

from __future__ import annotations

import math
import time
from abc import ABC, abstractmethod
from typing import Any

import torch

from services.common.devices import autocast
from services.contracts.config import AlgorithmConfig
from services.contracts.messages import Sample
from services.training.algorithms import Algorithm, Share, Stats, StepPlan, step_metrics
from services.training.algorithms.micro import combine, micro_counts, micro_slices, shares
from services.training.memory import ActivationMeter, memory_metrics
from services.training.value import ValueBaseline

Tensors = dict[str, torch.Tensor]


class NonFiniteStep(Exception):
    """The step produced a non-finite loss, gradient or weight; the message says which and where."""


def check_finite(stats: Stats, grad_norm: float, where: str) -> None:
    """Raise ``NonFiniteStep`` when the loss stats or the gradient norm (non-finite iff a gradient is) are."""
    bad = sorted(k for k, v in stats.items()
                 if (k == "loss" or k.endswith("_loss")) and isinstance(v, float) and not math.isfinite(v))
    if bad:
        raise NonFiniteStep(f"non-finite {', '.join(bad)} at {where}")
    if not math.isfinite(grad_norm):
        raise NonFiniteStep(f"non-finite gradient (norm {grad_norm}) at {where}")


def pad_batch(samples: list[Sample], pad_id: int) -> Tensors:
    """Right-padded tensors; targets are tokens shifted by one."""
    t = max(len(s.tokens) for s in samples)
    b = len(samples)
    tokens = torch.full((b, t), pad_id, dtype=torch.long)
    attn = torch.zeros((b, t), dtype=torch.long)
    mask = torch.zeros((b, t), dtype=torch.float32)
    old = torch.zeros((b, t), dtype=torch.float32)
    for i, s in enumerate(samples):
        n = len(s.tokens)
        tokens[i, :n] = torch.tensor(s.tokens)
        attn[i, :n] = 1
        mask[i, :n] = torch.tensor(s.loss_mask, dtype=torch.float32)
        old[i, :n] = torch.tensor(s.rollout_logprobs, dtype=torch.float32)
    return {"input_ids": tokens, "attention_mask": attn, "targets": tokens[:, 1:],
            "mask": mask[:, 1:], "old_logp": old[:, 1:]}


class TrainingStep(ABC):
    """The step skeleton; subclasses set the attributes below in ``__init__`` and implement the hooks."""

    backend: str  # the name reported in the metrics ("torch", "megatron")
    algo: Algorithm
    cfg: AlgorithmConfig
    weight_version: int
    pad_id: int
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    device: torch.device = torch.device("cpu")  # where the passes run
    precision: str = "float32"  # the agent's trainer.dtype: "bfloat16" autocasts the passes (weights stay float32)
    critic: ValueBaseline | None = None  # algorithm.baseline: value (value.py)
    micro_batch_size: int | None = None  # trainer.micro_batch_size: rows per pass (None, 0: the whole minibatch)
    _meter: ActivationMeter | None = None

    def rows(self, minibatch: list[int]) -> list[int]:
        """The rows of a minibatch this process trains on (all of them, unless data-parallel)."""
        return minibatch

    @abstractmethod
    def old_logprobs(self, batch: Tensors, reference: bool) -> torch.Tensor:
        """No-grad logprobs of the batch's targets under the current weights, or the frozen reference."""

    @abstractmethod
    def backward(self, batch: Tensors, plan: StepPlan, rows: list[int], prox: torch.Tensor | None,
                 ref: torch.Tensor | None, share: Share = Share()) -> Stats:
        """Forward with grad, the algorithm's loss on ``rows`` of the plan (scaled by ``share``: ``LossInputs``),
        backward; return the loss stats."""

    def micro(self, n: int) -> list[slice]:
        """The micro-batches of a minibatch of ``n`` rows (one of them all without ``micro_batch_size``)."""
        return micro_slices(self.algo, n, self.micro_batch_size)

    def chunked_logprobs(self, batch: Tensors, reference: bool) -> torch.Tensor:
        """``old_logprobs`` of the batch, a micro-batch at a time."""
        pieces = self.micro(batch["input_ids"].shape[0])
        if len(pieces) == 1:
            return self.old_logprobs(batch, reference)
        return torch.cat([self.old_logprobs({k: v[s] for k, v in batch.items()}, reference) for s in pieces])

    def accumulate(self, batch: Tensors, plan: StepPlan, rows: list[int], prox: torch.Tensor | None,
                   ref: torch.Tensor | None, meter: ActivationMeter) -> Stats:
        """Forward + loss + backward of a minibatch, in micro-batches (rows of its padded tensors, so every
        position and width is the minibatch's); the gradients accumulate, the stats combine (micro.py)."""
        pieces = self.micro(len(rows))
        if len(pieces) == 1:
            with meter.measure():
                return self.backward(batch, plan, rows, prox, ref)
        counts = micro_counts(batch["mask"], plan.stale[rows].to(batch["mask"].device), pieces)
        parts: list[Stats] = []
        for s, share in zip(pieces, shares(counts), strict=True):
            part = {k: v[s] for k, v in batch.items()}
            with meter.measure():  # one micro-batch's activations live at a time
                parts.append(self.backward(part, plan, rows[s], None if prox is None else prox[s],
                                           None if ref is None else ref[s], share))
        return combine(self.algo, parts, counts)

    def rebaseline(self, plan: StepPlan, rows: list[list[int]], batches: list[Tensors]) -> Stats:
        """Under ``algorithm.baseline: value``: the plan's advantages against the head's values, the head fitted
        (value.py); a non-finite value, fit or head fails the step (``NonFiniteStep``)."""
        if self.critic is None:
            return {}
        stats = self.critic.rebaseline(self.algo, plan, rows, batches)
        check_finite(stats, 0.0, "the value head")
        if not self.critic.finite():
            raise NonFiniteStep("non-finite value head after its fit")
        return stats

    @abstractmethod
    def clip_grads(self) -> float:
        """Clip the gradients to ``cfg.max_grad_norm``; return the norm before clipping."""

    def weights_finite(self) -> bool:
        """Whether every trainable weight is finite (after an optimizer step)."""
        params = getattr(self, "trainable", None) or [p for g in self.optimizer.param_groups for p in g["params"]]
        return all(bool(torch.isfinite(p).all()) for p in params)

    def all_params(self) -> list[torch.Tensor]:
        """Every weight of the policy, frozen ones too (the activation count leaves them out)."""
        model = getattr(self, "model", None)
        if isinstance(model, torch.nn.Module):
            return list(model.parameters())
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def activation_meter(self) -> ActivationMeter:
        if self._meter is None:
            self._meter = ActivationMeter(self.all_params())
        self._meter.reset()
        return self._meter

    def train_step(self, samples: list[Sample]) -> dict[str, Any]:
        start = time.perf_counter()
        meter = self.activation_meter()
        plan = self.algo.prepare(samples, self.weight_version)
        rows = [self.rows(mb) for mb in plan.minibatches]
        batches = [{k: v.to(self.device) for k, v in pad_batch([plan.samples[i] for i in r], self.pad_id).items()}
                   for r in rows]  # on the device once, for every pass over them
        none: list[torch.Tensor | None] = [None] * len(batches)
        with torch.no_grad(), autocast(self.device, self.precision):
            prox = [self.chunked_logprobs(b, False) for b in batches] if self.algo.needs_prox(plan) else none
            ref = [self.chunked_logprobs(b, True) for b in batches] if self.algo.needs_reference else none
        value_stats = self.rebaseline(plan, rows, batches)
        parts: list[Stats] = []
        grad_norms: list[float] = []
        for epoch in range(self.cfg.epochs if batches else 0):
            for k, r in enumerate(rows):
                self.optimizer.zero_grad(set_to_none=True)
                with autocast(self.device, self.precision):
                    stats = self.accumulate(batches[k], plan, r, prox[k], ref[k], meter)
                grad_norms.append(self.clip_grads())
                check_finite(stats, grad_norms[-1], f"epoch {epoch} minibatch {k}")
                self.optimizer.step()
                self.scheduler.step()
                parts.append(stats)
        if not self.weights_finite():
            raise NonFiniteStep("non-finite weights after the optimizer step")
        self.weight_version += 1
        return {**step_metrics(parts, samples, plan, self.cfg, self.backend, self.scheduler.get_last_lr()[0],
                               grad_norms, time.perf_counter() - start), **value_stats,
                **memory_metrics(meter, self.optimizer, [p for g in self.optimizer.param_groups for p in g["params"]],
                                 self.device)}
