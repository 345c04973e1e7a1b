"""LoRA training clients on a shared base: one frozen base model per directory, one peft adapter per client.

``BaseHost`` loads a base model once; every training client on it is a named peft adapter
(its own LoRA weights, its own AdamW), so an extra client costs its adapter, gradients and
optimizer state, not another copy of the base. Only one adapter is active at a time; the
service runs every training operation on one thread, so switching is safe.

``LoraClient`` is one training client, as Tinker defines it: ``forward_backward`` sums
the loss over the datums and ADDS its gradients to the ones already there; it runs forward
and backward per chunk of datums (``chunks``: at most ``LOGIT_BUDGET`` padded logits each,
one datum at least), freeing each chunk's logits before the next, so its peak memory is one
chunk's, not the call's. Every loss here is per datum (Tinker's batch loss is the sum of the
datums' losses; GSPO's sequence is one datum), so chunking changes only the summation order
of the gradients;
``optim_step`` applies AdamW with that call's hyper-parameters (and global-norm clipping
when ``grad_clip_norm`` > 0), then clears the gradients.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig as PeftLoraConfig
from peft import PeftModel, get_peft_model
from peft.tuners.lora import LoraLayer
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from services.tinker_api.losses import UserError

ATTN_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
LORA_ALPHA = 32.0  # Tinker's, on every rank (scale 32 / r): tinker-cookbook 0.5.8 hyperparam_utils (lora_alpha=32)
STATE_FILE = "tinker_state.pt"
LOGIT_BUDGET = 1 << 26  # padded positions x vocabulary per forward chunk (SmolLM2: 1,365 tokens, 256 MiB fp32)


@dataclass
class Datum:
    """One training example: its input tokens and its loss inputs (tensors aligned with the tokens)."""

    tokens: list[int]
    inputs: dict[str, torch.Tensor]


def target_modules(names: set[str], mlp: bool, attn: bool, unembed: bool) -> list[str]:
    wanted = [*(ATTN_MODULES if attn else ()), *(MLP_MODULES if mlp else ()), *(("lm_head",) if unembed else ())]
    found = [m for m in wanted if m in names]
    if not found:
        raise UserError(f"lora_config: none of {wanted} is a linear module of this model")
    return found


class BaseHost:
    """One base model directory: tokenizer, frozen weights, and the adapters of every client on it."""

    def __init__(self, path: str, device: str = "cpu") -> None:
        if not (Path(path) / "config.json").is_file():
            raise UserError(f"base_model: {path!r} is not a local model directory (no config.json)")
        self.path = path
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.device = torch.device(device)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(self.device)
        self.model: torch.nn.Module = model.requires_grad_(False)
        self.config = model.config
        self.linear_names = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
        self.peft: PeftModel | None = None
        pad = self.tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else 0)

    def add_adapter(self, name: str, rank: int, seed: int, mlp: bool, attn: bool, unembed: bool) -> list[str]:
        targets = target_modules(self.linear_names, mlp, attn, unembed)
        cfg = PeftLoraConfig(r=rank, lora_alpha=LORA_ALPHA, lora_dropout=0.0, target_modules=targets,
                             bias="none", task_type="CAUSAL_LM")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)  # the adapter's init (A: kaiming, B: zeros) depends on the seed only
            if self.peft is None:
                self.peft = get_peft_model(self.model, cfg, adapter_name=name)
            else:
                self.peft.add_adapter(name, cfg)
        return targets

    def drop_adapter(self, name: str) -> None:
        if self.peft is not None and name in self.peft.peft_config:
            self.peft.delete_adapter(name)
            left = list(self.peft.peft_config)
            if left:  # never leave a deleted adapter active: peft would look its config up
                self.peft.set_adapter(left[0])

    def activate(self, name: str) -> PeftModel:
        assert self.peft is not None
        self.peft.set_adapter(name)
        return self.peft

    def adapter_params(self, name: str) -> dict[str, torch.nn.Parameter]:
        assert self.peft is not None
        tag = f".{name}."
        return {n: p for n, p in self.peft.named_parameters() if "lora_" in n and tag in n}

    def merged_state(self, name: str | None) -> dict[str, torch.Tensor]:
        """Plain HF weights with adapter ``name`` folded in (None: the base); a fresh copy, base untouched."""
        base = self.model  # the transformers module itself (peft injected its LoRA layers in place)
        if name is not None:
            self.activate(name)
        state = {k.replace(".base_layer.", "."): v.detach().to("cpu", copy=True) for k, v in base.state_dict().items()
                 if "lora_" not in k}
        if name is not None and self.peft is not None:
            for mod_name, mod in base.named_modules():
                if isinstance(mod, LoraLayer) and name in mod.lora_A:
                    key = f"{mod_name}.weight"
                    state[key] = state[key] + mod.get_delta_weight(name).detach().cpu()
        return state

    def export(self, name: str | None, out_dir: Path) -> Path:
        """Write the merged weights as an HF directory (atomically: a temp dir, then rename)."""
        state = self.merged_state(name)
        tied = bool(getattr(self.config, "tie_word_embeddings", False))
        config = self.config.to_dict()
        if tied and "lm_head.weight" in state and not torch.equal(state["lm_head.weight"],
                                                                  state.get("model.embed_tokens.weight")):
            config["tie_word_embeddings"] = False  # the adapter changed the unembedding only: untie it
        elif tied:
            state.pop("lm_head.weight", None)
        tmp = out_dir.with_name(out_dir.name + f".tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        save_file({k: v.contiguous() for k, v in state.items()}, str(tmp / "model.safetensors"),
                  metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2, default=str))
        gen = Path(self.path) / "generation_config.json"
        if gen.is_file():
            shutil.copy(gen, tmp / "generation_config.json")
        self.tokenizer.save_pretrained(tmp)
        shutil.rmtree(out_dir, ignore_errors=True)
        os.replace(tmp, out_dir)
        return out_dir


def chunks(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Consecutive datum indices, grouped so each group's padded size (count x longest) stays within
    ``max_tokens``; a datum longer than that is a group of its own."""
    out: list[list[int]] = []
    longest = 0
    for i, n in enumerate(lengths):
        if out and max(longest, n) * (len(out[-1]) + 1) <= max_tokens:
            out[-1].append(i)
            longest = max(longest, n)
        else:
            out.append([i])
            longest = n
    return out


class LoraClient:
    """One Tinker training client: an adapter on a BaseHost, its AdamW, its accumulated gradients."""

    def __init__(self, host: BaseHost, name: str, rank: int, seed: int, mlp: bool, attn: bool,
                 unembed: bool) -> None:
        self.host, self.name, self.rank = host, name, rank
        self.targets = host.add_adapter(name, rank, seed, mlp, attn, unembed)
        self.params = list(host.adapter_params(name).values())
        self.optimizer = torch.optim.AdamW(self.params, lr=1e-4, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0)
        self.logit_budget = LOGIT_BUDGET

    def close(self) -> None:
        self.host.drop_adapter(self.name)

    # -- forward passes ------------------------------------------------------------------
    def _logprobs(self, data: list[Datum]) -> list[torch.Tensor]:
        """Each datum's target-token logprobs ([N] or [N, K]), from one right-padded batch forward."""
        model = self.host.activate(self.name)
        width = max(len(d.tokens) for d in data)
        ids = torch.full((len(data), width), self.host.pad_id, dtype=torch.long)
        mask = torch.zeros((len(data), width), dtype=torch.long)
        for i, d in enumerate(data):
            ids[i, :len(d.tokens)] = torch.tensor(d.tokens, dtype=torch.long)
            mask[i, :len(d.tokens)] = 1
        dev = self.host.device
        logits = model(input_ids=ids.to(dev), attention_mask=mask.to(dev)).logits
        out = []
        for i, d in enumerate(data):  # log p = logit - logsumexp, per datum: no [B, T, V] log-softmax copy
            targets = d.inputs["target_tokens"].long()
            rows = logits[i, :len(d.tokens)].float()
            picked = rows.gather(-1, targets.reshape(len(d.tokens), -1)) - torch.logsumexp(rows, -1, keepdim=True)
            out.append(picked.reshape(targets.shape))
        return out

    def forward_backward(self, data: list[Datum], loss: Any, backward: bool
                         ) -> tuple[list[torch.Tensor], float, dict[str, float]]:
        """``loss`` is a ``BuiltinLoss`` or a ``CustomLoss``: checks each datum, gives its loss and metrics."""
        vocab = int(self.host.config.vocab_size)
        context = getattr(self.host.config, "max_position_embeddings", None)
        for i, d in enumerate(data):
            if not d.tokens:
                raise UserError(f"data[{i}].model_input: empty")
            if context is not None and len(d.tokens) > int(context):
                raise UserError(f"data[{i}].model_input: {len(d.tokens)} tokens exceed the model's context of "
                                f"{int(context)} (max_position_embeddings)")
            bad = [t for t in d.tokens if not 0 <= t < vocab]
            if bad:
                raise UserError(f"data[{i}].model_input: token id {bad[0]} is outside the vocabulary ({vocab})")
            loss.check_datum(i, len(d.tokens), d.inputs)
            tt = d.inputs["target_tokens"]
            if bool(((tt < 0) | (tt >= vocab)).any()):
                raise UserError(f"data[{i}].loss_fn_inputs.target_tokens: ids outside the vocabulary ({vocab})")
            d.inputs = {k: v.to(self.host.device) for k, v in d.inputs.items()}
        saved = [None if p.grad is None else p.grad.clone() for p in self.params] if backward else []
        try:
            return self._chunked(data, loss, backward, self.logit_budget // vocab)
        except BaseException:
            for p, g in zip(self.params, saved, strict=True):  # a failing datum leaves no partial gradients
                p.grad = g
            raise

    def _chunked(self, data: list[Datum], loss: Any, backward: bool, max_tokens: int
                 ) -> tuple[list[torch.Tensor], float, dict[str, float]]:
        """Forward (and backward) chunk by chunk; the per-datum results, their summed loss and metrics."""
        logps: list[torch.Tensor] = []
        losses: list[torch.Tensor] = []
        per_datum: list[dict[str, torch.Tensor]] = []
        for chunk in chunks([len(d.tokens) for d in data], max_tokens):
            with torch.set_grad_enabled(backward):
                part = self._logprobs([data[i] for i in chunk])
                outs = [loss(lp, data[i].inputs) for lp, i in zip(part, chunk, strict=True)]
                if backward:
                    sum(x for x, _ in outs).backward()  # type: ignore[union-attr]  # adds to earlier gradients
            logps += [lp.detach().cpu() for lp in part]
            losses += [x.detach() for x, _ in outs]
            per_datum += [{k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in m.items()}
                          for _, m in outs]
            del part, outs  # this chunk's logits and graph go before the next chunk's forward
        total = sum(losses)  # the same order of float additions as one whole-batch sum
        assert isinstance(total, torch.Tensor)
        return logps, float(total), loss.metrics(per_datum)

    def optim_step(self, params: dict[str, Any]) -> dict[str, float]:
        for group in self.optimizer.param_groups:
            group.update(lr=float(params["learning_rate"]), betas=(float(params["beta1"]), float(params["beta2"])),
                         eps=float(params["eps"]), weight_decay=float(params["weight_decay"]))
        grads = [p.grad for p in self.params if p.grad is not None]
        total = torch.nn.utils.get_total_norm(grads) if grads else None
        norm = float(total) if total is not None else 0.0
        if params["grad_clip_norm"] > 0 and total is not None:
            torch.nn.utils.clip_grads_with_norm_(self.params, params["grad_clip_norm"], total)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"grad_norm:mean": norm, "learning_rate:mean": float(params["learning_rate"])}

    # -- training state ------------------------------------------------------------------
    def state(self, optimizer: bool) -> dict[str, Any]:
        weights = {n.replace(f".{self.name}.", ".adapter."): p.detach().to("cpu", copy=True)
                   for n, p in self.host.adapter_params(self.name).items()}
        out: dict[str, Any] = {"weights": weights, "rank": self.rank, "targets": self.targets}
        if optimizer:
            out["optimizer"] = self.optimizer.state_dict()
        return out

    def load(self, state: dict[str, Any], optimizer: bool) -> None:
        params = self.host.adapter_params(self.name)
        want = {n.replace(f".{self.name}.", ".adapter."): p for n, p in params.items()}
        if set(want) != set(state["weights"]):
            raise UserError("path: the checkpoint's LoRA layout (rank, trained modules) differs from this model's")
        with torch.no_grad():
            for n, p in want.items():
                t = state["weights"][n]
                if t.shape != p.shape:
                    raise UserError(f"path: checkpoint tensor {n} has shape {list(t.shape)}, "
                                    f"this model's is {list(p.shape)}")
                p.copy_(t)
        for p in self.params:
            p.grad = None
        if optimizer:
            if "optimizer" not in state:
                raise UserError("path: this checkpoint holds no optimizer state (saved with save_weights_for_sampler?)")
            self.optimizer.load_state_dict(state["optimizer"])
        else:
            self.optimizer = torch.optim.AdamW(self.params, lr=1e-4, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0)
