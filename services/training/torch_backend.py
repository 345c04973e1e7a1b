"""PyTorch + transformers training backend (CPU, or one GPU: ``trainer.device``, bf16 autocast by ``trainer.dtype``).

Holds the policy (optionally LoRA adapters on a frozen base), a frozen reference when
the algorithm needs one, AdamW and the LR scheduler; trains one batch per
``train_step`` with the configured algorithm (``services.training.algorithms``; activation checkpointing
by ``trainer.gradient_checkpointing``, micro-batches of ``trainer.micro_batch_size`` rows; the training passes
take the logits at the loss-masked positions alone when the model can),
writes each version as an HF directory the engines load (under LoRA: the PEFT adapter alone), and
saves / restores the full training state for resume.
"""

from __future__ import annotations

import copy
import importlib
import inspect
import logging
import os
import random
import shutil
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

from services.common.devices import autocast, resolve, restore_rng, rng_states, training_precision
from services.common.extras import require
from services.common.weights_auth import weights_checksum
from services.contracts.config import AgentConfig
from services.training.algorithms import Share, Stats, StepPlan, make_algorithm, make_inputs
from services.training.grpo import token_entropy, token_logprobs
from services.training.schedule import lr_factor
from services.training.step import Tensors, TrainingStep, pad_batch
from services.training.value import ValueBaseline

__all__ = ["TorchPolicy", "pad_batch", "replace_dir"]

STATE_FILE = "trainer_state.pt"
log = logging.getLogger("tandem.trainer")


def lora() -> ModuleType:
    """The LoRA helpers, imported only by agents that use LoRA (peft is slow to import, and the `lora` extra)."""
    require("lora", "agents.X.lora")
    return importlib.import_module("services.training.lora")


def keeps_logits(model: torch.nn.Module, device: torch.device) -> bool:
    """Whether the model takes a boolean ``logits_to_keep`` [B, T] (transformers' ``slice_logits_to_keep``): the
    logits of its True positions alone, flattened to [N, V]. Asked with one 3-token forward."""
    if "logits_to_keep" not in inspect.signature(model.forward).parameters:
        return False
    keep = torch.tensor([[True, False, True]], device=device)
    try:
        with torch.no_grad():
            out = model(input_ids=torch.zeros((1, 3), dtype=torch.long, device=device), logits_to_keep=keep)
    except (TypeError, ValueError, IndexError, RuntimeError):
        return False
    return tuple(out.logits.shape[:-1]) == (2,)


def spread(flat: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """[1, N] values of the True positions of ``keep`` [B, T] back to [B, T], 0 elsewhere (with their gradient)."""
    return flat.new_zeros(keep.shape).index_put((keep,), flat[0])


def replace_dir(tmp: Path, out_dir: Path) -> None:
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)


class TorchPolicy(TrainingStep):
    """The torch backend; ``weight_version`` is the weight version its weights are (0 = the start model)."""

    backend = "torch"
    follower = False  # one process: no ranks to follow

    def __init__(self, acfg: AgentConfig, temperature: float) -> None:
        torch.manual_seed(acfg.seed)
        random.seed(acfg.seed)
        self.acfg, self.cfg, self.temperature = acfg, acfg.algorithm, temperature
        self.algo = make_algorithm(self.cfg)
        self.weight_version = 0
        self.tokenizer = AutoTokenizer.from_pretrained(acfg.model_path)
        self.device = resolve(acfg.trainer.device, "trainer.device")
        self.precision = training_precision(self.device, acfg.trainer.dtype)
        self.micro_batch_size = acfg.trainer.micro_batch_size
        if self.precision != acfg.trainer.dtype:
            log.warning("trainer.dtype: bfloat16 autocast is slower than float32 on a CPU without native bf16 "
                        "(AVX512-BF16/AMX); training in float32")
        base = AutoModelForCausalLM.from_pretrained(acfg.model_path, dtype=torch.float32).to(self.device)
        self.keeps_logits = keeps_logits(base, self.device)
        if acfg.trainer.gradient_checkpointing:  # recompute each layer's activations in the backward pass
            base.config.use_cache = False
            base.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        self.reference: torch.nn.Module | None = None
        if acfg.lora is not None:
            self.model: torch.nn.Module = lora().add_adapters(base, acfg.lora)  # reference = adapters disabled
        else:
            self.model = base
            if self.algo.needs_reference:
                self.reference = copy.deepcopy(base).eval().requires_grad_(False)
        self.model.train()
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.trainable, lr=self.cfg.lr, weight_decay=self.cfg.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: lr_factor(self.cfg, s))
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        if self.cfg.baseline == "value":
            self.critic = ValueBaseline(base.config.hidden_size, self.cfg, self.device, self.state_features)

    # -- forward passes ------------------------------------------------------------------
    def forward(self, batch: dict[str, torch.Tensor], model: torch.nn.Module | None = None,
                entropy: bool = False, masked: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logprobs [B, T-1] of the batch's targets (and their entropy). ``masked``: the logits only at the
        positions of the loss mask, where the model takes a boolean ``logits_to_keep`` (the vocabulary-sized
        tensors shrink to the trained tokens); 0 at the other positions, which every loss masks out."""
        keep = batch["mask"] > 0 if masked and self.keeps_logits else None
        extra = {} if keep is None else {"logits_to_keep": F.pad(keep, (0, 1))}  # position t predicts target t
        out = (model or self.model)(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], **extra)
        logits = out.logits[:, :-1] if keep is None else out.logits.unsqueeze(0)  # [B, T-1, V] or [1, N, V]
        targets = batch["targets"] if keep is None else batch["targets"][keep].unsqueeze(0)
        logp, ent = token_logprobs(logits, targets, self.temperature), None
        if entropy and self.algo.needs_entropy_grad:
            ent = token_entropy(logits, self.temperature)
        elif entropy:
            with torch.no_grad():
                ent = token_entropy(logits.detach(), self.temperature)
        if keep is None:
            return logp, ent
        return spread(logp, keep), None if ent is None else spread(ent, keep)

    def logprobs(self, batch: dict[str, torch.Tensor], masked: bool = False) -> torch.Tensor:
        return self.forward(batch, masked=masked)[0]

    @torch.no_grad()
    def reference_logprobs(self, batch: dict[str, torch.Tensor], masked: bool = False) -> torch.Tensor:
        if self.reference is not None:
            return self.forward(batch, self.reference, masked=masked)[0]
        with self.model.disable_adapter():  # LoRA: the frozen base is the reference
            return self.forward(batch, masked=masked)[0]

    # -- the hooks of the shared training step ---------------------------------------------
    def old_logprobs(self, batch: Tensors, reference: bool) -> torch.Tensor:
        return self.reference_logprobs(batch, masked=True) if reference else self.logprobs(batch, masked=True)

    def backward(self, batch: Tensors, plan: StepPlan, rows: list[int], prox: torch.Tensor | None,
                 ref: torch.Tensor | None, share: Share = Share()) -> Stats:
        logp, ent = self.forward(batch, entropy=True, masked=True)
        adv = plan.advantages_for(rows, batch["mask"].shape[1]).to(self.device)
        x = make_inputs(self.cfg, logp, batch["old_logp"], batch["mask"], adv,
                        plan.stale[rows].to(self.device), prox, ref, ent)
        x.share = share
        loss, stats = self.algo.loss(x)
        loss.backward()
        return stats

    @torch.no_grad()
    def state_features(self, batch: Tensors, positions: list[list[int]]) -> torch.Tensor:
        """The value baseline's input (value.py): the last hidden state at each row's turn-state positions
        (a micro-batch of rows at a time)."""
        rows: list[torch.Tensor] = []
        for s in self.micro(len(positions)):
            with autocast(self.device, self.precision):
                out = self.model(input_ids=batch["input_ids"][s], attention_mask=batch["attention_mask"][s],
                                 output_hidden_states=True)
            last = out.hidden_states[-1]
            rows += [last[j, pos] for j, pos in enumerate(positions[s])]
        return torch.cat(rows)

    def clip_grads(self) -> float:
        return float(torch.nn.utils.clip_grad_norm_(self.trainable, self.cfg.max_grad_norm))

    # -- weights for the engines ---------------------------------------------------------
    def save(self, out_dir: Path) -> tuple[Path, str]:
        """Write an HF directory atomically (tmp dir + rename); return (path, checksum). LoRA: the adapter
        alone (PEFT format, naming the base), which the engines serve on their resident base."""
        tmp = out_dir.with_name(out_dir.name + f".tmp{os.getpid()}")
        if tmp.exists():
            shutil.rmtree(tmp)
        if self.acfg.lora is not None:
            lora().save_adapter(self.model, tmp, self.acfg.model_path)
        else:
            self.model.save_pretrained(tmp, safe_serialization=True)
            self.tokenizer.save_pretrained(tmp)
        replace_dir(tmp, out_dir)
        return out_dir, weights_checksum(out_dir)

    def save_full(self, out_dir: Path) -> Path:
        """Write a full HF directory atomically, one a ``model_path`` can name: the weights (under LoRA the base
        with the adapter folded in) and the tokenizer."""
        if self.acfg.lora is None:
            return self.save(out_dir)[0]
        tmp = out_dir.with_name(out_dir.name + f".tmp{os.getpid()}")
        if tmp.exists():
            shutil.rmtree(tmp)
        lora().save_merged(self.model, self.tokenizer, tmp)
        replace_dir(tmp, out_dir)
        return out_dir

    # -- full training state for resume --------------------------------------------------
    def save_state(self, path: Path, version: int) -> Path:
        """Weights (adapters only under LoRA), optimizer, scheduler, RNG, version: one dir, written atomically."""
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        weights = lora().adapter_state(self.model) if self.acfg.lora is not None else self.model.state_dict()
        torch.save({"version": version, "algorithm": self.cfg.name, "lora": self.acfg.lora is not None,
                    "model": weights, "optimizer": self.optimizer.state_dict(),
                    "scheduler": self.scheduler.state_dict(), **rng_states(),
                    **({"critic": self.critic.state_dict()} if self.critic is not None else {}),
                    "python_rng": random.getstate()}, tmp / STATE_FILE)
        replace_dir(tmp, path)
        return path

    def load_state(self, path: Path) -> int:
        state = torch.load(Path(path) / STATE_FILE, weights_only=False)
        if state["lora"] != (self.acfg.lora is not None):
            raise ValueError(f"trainer state {path} was written with lora={'on' if state['lora'] else 'off'}; "
                             "the config now says otherwise")
        if self.acfg.lora is not None:
            lora().load_adapter_state(self.model, state["model"])
        else:
            self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if self.critic is not None:  # a state from before baseline: value starts the head afresh
            self.critic.load_state_dict(state.get("critic"))
        restore_rng(state)
        random.setstate(state["python_rng"])
        self.weight_version = int(state["version"])
        return self.weight_version

    # -- ranks: a single process has none ------------------------------------------------
    def follow(self) -> None:
        raise RuntimeError("the torch backend runs in one process; it has no follower rank")

    def close(self) -> None:
        """Nothing to release: the torch backend holds no other process."""
