"""The megatron-core training backend: ``MegatronPolicy(acfg, temperature)``.

Same contract as the torch backend (``services.training.backends``): ``train_step``,
``save`` (an HF directory the engines load), ``save_state``/``load_state``, ``weight_version``.
The maths is the shared algorithm registry; this module owns the megatron side: the
GPTModel (tensor/pipeline parallel), forward and backward through megatron's pipeline
schedule, data-parallel gradient averaging, grad-norm clipping over the model-parallel
group, AdamW and the LR schedule.

Under ``torchrun`` every rank builds the policy; rank 0 runs the trainer service and
drives the others: each public call on rank 0 is first broadcast to the other ranks,
which sit in ``follow()`` and run the same call.
"""

from __future__ import annotations

import os
import random
import shutil
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region, get_cuda_rng_tracker
from transformers import AutoConfig, AutoTokenizer

from services.common.devices import resolve, restore_rng, rng_states
from services.common.weights_auth import weights_checksum
from services.contracts.config import AgentConfig
from services.contracts.messages import Sample
from services.training.algorithms import Share, Stats, StepPlan, make_algorithm, make_inputs
from services.training.grpo import token_entropy, token_logprobs
from services.training.megatron.layout import check_layout
from services.training.megatron.model import arch_of, build_model, init_parallel
from services.training.megatron.weights import (
    global_name,
    hf_to_mcore,
    load_hf_state,
    mcore_to_hf,
    shard,
    unshard,
)
from services.training.schedule import lr_factor
from services.training.step import Tensors, TrainingStep
from services.training.torch_backend import replace_dir

STATE_FILE = "megatron_rank{tp}_{pp}.pt"


def write_hf_dir(tmp: Path, tensors: dict[str, torch.Tensor], hf_config: Any, tokenizer: Any,
                 source: Path) -> None:
    """config.json, model.safetensors, the tokenizer, and the source's generation_config.json if it has one."""
    from safetensors.torch import save_file

    tmp.mkdir(parents=True)
    hf_config.save_pretrained(tmp)
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(tmp)
    if (source / "generation_config.json").is_file():
        shutil.copyfile(source / "generation_config.json", tmp / "generation_config.json")


class MegatronPolicy(TrainingStep):
    """The megatron backend; ``weight_version`` is the weight version its weights are (0 = the start model)."""

    backend = "megatron"

    def __init__(self, acfg: AgentConfig, temperature: float) -> None:
        self.acfg, self.cfg, self.temperature = acfg, acfg.algorithm, temperature
        lay = acfg.megatron
        self.hf_config = AutoConfig.from_pretrained(acfg.model_path)
        self.arch = arch_of(self.hf_config)
        world = int(os.environ.get("WORLD_SIZE", "1"))
        on_gpu = resolve(acfg.trainer.device, "trainer.device").type == "cuda"  # (cuda without a GPU: refused)
        check_layout(lay, self.arch, world, on_gpu)
        self.on_gpu = init_parallel(lay.tensor_parallel, lay.pipeline_parallel, acfg.seed, on_gpu)
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.on_gpu else torch.device("cpu")
        self.precision = acfg.trainer.dtype  # bf16 autocast of the passes; weights and AdamW stay float32
        random.seed(acfg.seed)
        self.rank = dist.get_rank()
        self.follower = self.rank != 0
        self.algo = make_algorithm(self.cfg)
        self.weight_version = 0
        self.tokenizer = AutoTokenizer.from_pretrained(acfg.model_path)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        hf_state = load_hf_state(acfg.model_path)
        self.dtypes = {k: v.dtype for k, v in hf_state.items()}
        full = hf_to_mcore(hf_state, self.arch)
        self.model = self._build(full)
        self.reference = self._build(full).eval().requires_grad_(False) if self.algo.needs_reference else None
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=self.cfg.lr, weight_decay=self.cfg.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: lr_factor(self.cfg, s))
        self.forward_backward = get_forward_backward_func()

    # -- model and weights ---------------------------------------------------------------
    def _build(self, full: dict[str, torch.Tensor]) -> torch.nn.Module:
        model = build_model(self.hf_config, self.on_gpu)
        self._load(model, full)
        return model

    def _offset(self, model: torch.nn.Module) -> int:
        layers = model.decoder.layers
        return layers[0].layer_number - 1 if len(layers) else 0

    def _load(self, model: torch.nn.Module, full: dict[str, torch.Tensor]) -> None:
        """Copy whole megatron tensors into this rank's (TP slice, PP stage of the) model."""
        tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
        offset = self._offset(model)
        with torch.no_grad():
            for name, param in model.named_parameters():
                key = global_name(name, offset)
                if key == "output_layer.weight" and self.arch.tied:  # the last stage's copy of the embedding
                    key = "embedding.word_embeddings.weight"
                if key not in full:
                    raise KeyError(f"{self.acfg.model_path}: no HF weight maps to megatron parameter {key}")
                src = shard(full[key], name, param, tp, tp_rank)
                if src.shape != param.shape:
                    raise ValueError(f"{key}: HF weight gives shape {tuple(src.shape)}, model wants "
                                     f"{tuple(param.shape)}")
                param.copy_(src.to(param.dtype))

    def full_state(self) -> dict[str, torch.Tensor] | None:
        """Whole megatron tensors on global rank 0 (gathered over TP and PP); None elsewhere."""
        tp_group = ps.get_tensor_model_parallel_group()
        tp = ps.get_tensor_model_parallel_world_size()
        offset = self._offset(self.model)
        local: dict[str, torch.Tensor] = {}
        for name, param in self.model.named_parameters():
            if name == "output_layer.weight" and self.arch.tied:
                continue
            t = param.detach()
            pieces = [t]
            if tp > 1 and getattr(param, "tensor_model_parallel", False):
                pieces = [torch.empty_like(t) for _ in range(tp)]
                dist.all_gather(pieces, t.contiguous(), group=tp_group)
            local[global_name(name, offset)] = unshard(pieces, name, param).cpu()
        if ps.get_data_parallel_rank() != 0 or ps.get_tensor_model_parallel_rank() != 0:
            return None
        if ps.get_pipeline_model_parallel_world_size() > 1:
            stages: list[Any] = [None] * ps.get_pipeline_model_parallel_world_size()
            dist.all_gather_object(stages, local, group=ps.get_pipeline_model_parallel_group())
            local = {k: v for part in stages for k, v in part.items()}
        return local if self.rank == 0 else None

    def hf_state(self) -> dict[str, torch.Tensor] | None:
        full = self.full_state()
        if full is None:
            return None
        return {k: v.to(self.dtypes.get(k, v.dtype)) for k, v in mcore_to_hf(full, self.arch).items()}

    # -- forward -------------------------------------------------------------------------
    def _forward_step(self, batch: dict[str, torch.Tensor], loss_fn: Any, data: Any, model: torch.nn.Module) -> Any:
        ids = batch["input_ids"]
        b, t = ids.shape
        pos = torch.arange(t, device=ids.device).unsqueeze(0).expand(b, t)
        causal = torch.ones(t, t, dtype=torch.bool, device=ids.device).triu(1)
        pad = ~batch["attention_mask"].bool()
        mask = (causal.unsqueeze(0) | pad.unsqueeze(1)).unsqueeze(1)  # [b, 1, t, t], True = masked out
        return model(ids, pos, mask), partial(self._on_logits, batch, loss_fn)

    def _on_logits(self, batch: dict[str, torch.Tensor], loss_fn: Any, logits: torch.Tensor) -> Any:
        if ps.get_tensor_model_parallel_world_size() > 1:
            logits = gather_from_tensor_model_parallel_region(logits)
        logits = logits[:, :-1]
        return loss_fn(logits, token_logprobs(logits, batch["targets"], self.temperature))

    def _run(self, batch: dict[str, torch.Tensor], loss_fn: Any, model: torch.nn.Module,
             forward_only: bool) -> list[Any]:
        """One microbatch through megatron's schedule (pipeline stages included); outputs of the last stage."""
        batch = {k: v.to(torch.cuda.current_device()) if self.on_gpu else v for k, v in batch.items()}
        model.config.finalize_model_grads_func = None  # this class reduces gradients itself
        return self.forward_backward(
            forward_step_func=partial(self._forward_step, batch, loss_fn), data_iterator=iter([None]),
            model=[model], num_microbatches=1, seq_length=batch["input_ids"].shape[1],
            micro_batch_size=batch["input_ids"].shape[0], forward_only=forward_only)

    def _last_stage_result(self, outputs: list[Any]) -> Any:
        """The schedule returns results on the last pipeline stage; share them with every stage."""
        if ps.get_pipeline_model_parallel_world_size() == 1:
            return outputs[0]
        box = [outputs[0] if outputs else None]
        last = ps.get_pipeline_model_parallel_last_rank()
        dist.broadcast_object_list(box, src=last, group=ps.get_pipeline_model_parallel_group())
        return box[0]

    @torch.no_grad()
    def logprobs(self, batch: dict[str, torch.Tensor], model: torch.nn.Module | None = None) -> torch.Tensor:
        def keep(_logits: torch.Tensor, logp: torch.Tensor) -> Any:
            return torch.zeros((), device=logp.device), {"logp": logp.cpu()}
        return self._last_stage_result(self._run(batch, keep, model or self.model, True))["logp"]

    # -- the hooks of the shared training step ---------------------------------------------
    def rows(self, mb: list[int]) -> list[int]:
        """This data-parallel rank's rows of a minibatch (all of them when it has fewer rows than ranks)."""
        dp, r = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        return mb[r::dp] if len(mb) >= dp else mb

    def clip_grads(self) -> float:
        """Average the gradients over data-parallel ranks, then clip them over the model-parallel group."""
        for p in self.params:  # rows the loss did not reach still take part in every all-reduce
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if ps.get_pipeline_model_parallel_world_size() > 1 and self.arch.tied and ps.is_rank_in_embedding_group():
            dist.all_reduce(self.model.shared_embedding_or_output_weight().grad, group=ps.get_embedding_group())
        dp = ps.get_data_parallel_world_size()
        if dp > 1:
            flat = torch.cat([p.grad.reshape(-1) for p in self.params])
            dist.all_reduce(flat, group=ps.get_data_parallel_group())
            flat /= dp
            i = 0
            for p in self.params:
                p.grad.copy_(flat[i:i + p.numel()].view_as(p))
                i += p.numel()
        sq = torch.zeros((), dtype=torch.float32, device=self.params[0].device)
        tp_rank, last = ps.get_tensor_model_parallel_rank(), ps.is_pipeline_last_stage()
        for name, p in self.model.named_parameters():
            duplicate_tp = tp_rank > 0 and not getattr(p, "tensor_model_parallel", False)
            duplicate_emb = (name == "output_layer.weight" and self.arch.tied and last
                             and ps.get_pipeline_model_parallel_world_size() > 1)
            if p.requires_grad and not (duplicate_tp or duplicate_emb):
                sq += p.grad.float().pow(2).sum()
        dist.all_reduce(sq, group=ps.get_model_parallel_group())
        norm = float(sq.sqrt())
        coef = self.cfg.max_grad_norm / (norm + 1e-6)
        if coef < 1.0:
            for p in self.params:
                p.grad.mul_(coef)
        return norm

    def _average(self, stats: dict[str, float]) -> dict[str, float]:
        dp = ps.get_data_parallel_world_size()
        if dp == 1 or not stats:
            return stats
        keys = sorted(stats)
        t = torch.tensor([stats[k] for k in keys], dtype=torch.float64, device=self.params[0].device)  # nccl: on GPU
        dist.all_reduce(t, group=ps.get_data_parallel_group(), op=dist.ReduceOp.SUM)
        return {k: float(v) / dp for k, v in zip(keys, t.tolist(), strict=True)}

    def old_logprobs(self, batch: Tensors, reference: bool) -> torch.Tensor:
        return self.logprobs(batch, self.reference if reference else None)

    def backward(self, batch: Tensors, plan: StepPlan, rows: list[int], prox: torch.Tensor | None,
                 ref: torch.Tensor | None, share: Share = Share()) -> Stats:
        def loss_fn(logits: torch.Tensor, logp: torch.Tensor) -> Any:
            ent = token_entropy(logits if self.algo.needs_entropy_grad else logits.detach(), self.temperature)
            dev = logp.device
            x = make_inputs(self.cfg, logp, batch["old_logp"].to(dev), batch["mask"].to(dev),
                            plan.advantages_for(rows, batch["mask"].shape[1]).to(dev), plan.stale[rows].to(dev),
                            None if prox is None else prox.to(dev), None if ref is None else ref.to(dev), ent)
            x.share = share
            return self.algo.loss(x)

        return self._average(self._last_stage_result(self._run(batch, loss_fn, self.model, False)))

    def train_step(self, samples: list[Sample]) -> dict[str, Any]:
        self._lead("train_step", samples)
        return super().train_step(samples)

    # -- weights for the engines ---------------------------------------------------------
    def save(self, out_dir: Path) -> tuple[Path, str]:
        """Write an HF directory (config, model.safetensors, tokenizer) atomically; return (path, sha256)."""
        self._lead("save", out_dir)
        out_dir = Path(out_dir)
        tensors = self.hf_state()
        if tensors is None:
            return out_dir, ""
        tmp = out_dir.with_name(out_dir.name + f".tmp{os.getpid()}")
        if tmp.exists():
            shutil.rmtree(tmp)
        write_hf_dir(tmp, tensors, self.hf_config, self.tokenizer, Path(self.acfg.model_path))
        replace_dir(tmp, out_dir)
        return out_dir, weights_checksum(out_dir)

    # -- full training state for resume --------------------------------------------------
    def _state_file(self, path: Path) -> Path:
        return Path(path) / STATE_FILE.format(tp=ps.get_tensor_model_parallel_rank(),
                                              pp=ps.get_pipeline_model_parallel_rank())

    def save_state(self, path: Path, version: int) -> Path:
        """Each model-parallel rank's weights, optimizer, scheduler and RNG, plus the version: one dir, atomically."""
        self._lead("save_state", path, version)
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp-megatron")  # the same name on every rank
        if self.rank == 0:
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)
        self._barrier()
        if ps.get_data_parallel_rank() == 0:  # data-parallel replicas hold the same state
            torch.save({"version": version, "algorithm": self.cfg.name, "model": self.model.state_dict(),
                        "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                        **rng_states(), "python_rng": random.getstate(),
                        "tracker_rng": get_cuda_rng_tracker().get_states()}, self._state_file(tmp))
        self._barrier()
        if self.rank == 0:
            replace_dir(tmp, path)
        self._barrier()
        return path

    def load_state(self, path: Path) -> int:
        self._lead("load_state", path)
        state = torch.load(self._state_file(Path(path)), weights_only=False)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        restore_rng(state)
        random.setstate(state["python_rng"])
        get_cuda_rng_tracker().set_states(state["tracker_rng"])
        self.weight_version = int(state["version"])
        return self.weight_version

    # -- rank 0 drives the other ranks ---------------------------------------------------
    def _broadcast(self, obj: Any) -> Any:
        if dist.get_world_size() == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _barrier(self) -> None:
        if dist.get_world_size() > 1:
            dist.barrier()

    def _lead(self, method: str, *args: Any) -> None:
        if self.rank == 0 and dist.get_world_size() > 1:
            self._broadcast((method, args))

    def follow(self) -> None:
        """Non-zero ranks: run what rank 0 runs, until it calls ``close``."""
        while True:
            method, args = self._broadcast(None)
            if method == "close":
                return
            getattr(self, method)(*args)

    def close(self) -> None:
        self._lead("close")
