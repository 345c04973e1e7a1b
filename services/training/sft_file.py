"""Supervised training from a chat-format JSONL file (``agents.X.sft``; ``tandem sft``, ``tandem pipeline``).

``file_sample`` turns one record into a ``Sample`` the way a live episode builds one: the conversation is
rendered turn by turn with the agent's chat template (``ChatRenderer``, token-exact), each assistant
message is the tokens an engine would have generated (its content, then the end-of-sequence token) with
``loss_mask`` 1 on them, and every other token (system, user and tool messages, the template's headers)
has mask 0, so the SFT loss covers only the assistant tokens. ``train_from_file`` runs the agent's
``algorithm: sft`` (the trainer's own backend and step: its lr, minibatches, schedule, ``sft_min_reward``)
over the file for ``epochs``, in steps of ``batch_size`` samples, writes the last version as a full HF
directory ``<out>/v#####`` (one version per step, as the trainer counts them) and reports the file's mean
per-token NLL (temperature 1) before and after. With ``lora`` it trains the adapters on the frozen base and
the checkpoint is the base with the adapter merged in (not an adapter directory), so any stage, with or
without ``lora`` of its own, starts from it as its ``model_path``.
"""

from __future__ import annotations

import json
import logging
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from services.contracts.config import AgentConfig, SftRecord
from services.contracts.messages import Sample
from services.envs.render import ChatRenderer
from services.training.algorithms import masked_mean
from services.training.step import pad_batch

log = logging.getLogger("tandem.sft")


def file_sample(tokenizer: Any, record: SftRecord, agent: str, episode_id: str) -> Sample:
    """The record as the agent's view: template tokens (mask 0) and assistant tokens (mask 1)."""
    messages = record.messages
    system = messages[0].content if messages[0].role == "system" else None
    renderer = ChatRenderer(tokenizer, system)
    tokens: list[int] = []
    mask: list[int] = []
    for m in messages[1 if system is not None else 0:]:
        if m.role == "assistant":
            ids = list(tokenizer.encode(m.content, add_special_tokens=False)) + [tokenizer.eos_token_id]
            renderer.assistant_turn(ids)
            tokens += ids
            mask += [1] * len(ids)
        else:
            delta = renderer.user_turn(m.content, m.role)
            tokens += delta
            mask += [0] * len(delta)
    turns = sum(1 for m in messages if m.role == "assistant")
    return Sample(agent=agent, role=agent, episode_id=episode_id, group_id=episode_id, group_samples=1,
                  tokens=tokens, loss_mask=mask, rollout_logprobs=[0.0] * len(tokens), reward=record.reward,
                  weight_versions=[record.weight_version] * turns)


def file_samples(tokenizer: Any, path: str, agent: str,
                 context: int | None = None) -> tuple[list[Sample], dict[str, int]]:
    """The agent's samples of the file (records naming another agent are left out), and how many records were
    read, left to other agents, or too long for ``context`` tokens."""
    counts = {"records": 0, "other_agents": 0, "too_long": 0}
    out: list[Sample] = []
    for n, record in enumerate(SftRecord.read_file(path)):
        counts["records"] += 1
        if record.agent is not None and record.agent != agent:
            counts["other_agents"] += 1
            continue
        sample = file_sample(tokenizer, record, agent, f"{Path(path).name}:{n + 1}")
        if context is not None and len(sample.tokens) > context:
            counts["too_long"] += 1
            continue
        out.append(sample)
    return out, counts


@dataclass
class SftResult:
    """What a run of ``train_from_file`` did: its checkpoint, the versions (steps), the loss before and after."""

    agent: str
    dataset: str
    checkpoint: str
    weight_version: int
    samples: int
    steps: int
    nll_before: float
    nll_after: float
    start_model: str
    counts: dict[str, int]
    seconds: float
    lora: dict[str, Any] | None = None  # the adapters trained (then merged into the checkpoint); None: every weight

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@torch.no_grad()
def mean_nll(policy: Any, samples: list[Sample], batch_size: int) -> float:
    """The samples' mean per-token NLL on their masked (assistant) tokens under the policy's weights."""
    total = count = 0.0
    for start in range(0, len(samples), batch_size):
        batch = {k: v.to(policy.device) for k, v in pad_batch(samples[start:start + batch_size],
                                                              policy.pad_id).items()}
        logp = policy.old_logprobs(batch, reference=False)
        tokens = float(batch["mask"].sum())
        total += float(masked_mean(-logp, batch["mask"])) * tokens
        count += tokens
    return total / max(count, 1.0)


def train_from_file(acfg: AgentConfig, agent: str, out_dir: Path) -> SftResult:
    """Train ``agent`` on ``acfg.sft.dataset`` with its ``algorithm: sft``; write the last version under ``out_dir``."""
    from services.training.torch_backend import TorchPolicy  # torch and transformers: only now

    spec = acfg.sft
    if spec is None:
        raise ValueError(f"agents.{agent}.sft: not set (a dataset, with algorithm.name sft)")
    start = time.perf_counter()
    policy = TorchPolicy(acfg, temperature=1.0)
    context = getattr(policy.model.config, "max_position_embeddings", None)
    samples, counts = file_samples(policy.tokenizer, spec.dataset, agent, context)
    selected = policy.algo.select(samples)  # algorithm.sft_min_reward
    counts["below_min_reward"] = len(samples) - len(selected)
    samples = selected[:spec.max_samples]
    if not samples:
        raise ValueError(f"agents.{agent}.sft.dataset: {spec.dataset} holds no sample for agent {agent!r} "
                         f"({counts['records']} records, {counts['other_agents']} of other agents, "
                         f"{counts['too_long']} longer than the model's {context} tokens, "
                         f"{counts['below_min_reward']} below algorithm.sft_min_reward)")
    before = mean_nll(policy, samples, spec.batch_size)
    rng = random.Random(acfg.seed)
    steps = 0
    for epoch in range(spec.epochs):
        order = list(samples)
        rng.shuffle(order)
        for i in range(0, len(order), spec.batch_size):
            metrics = policy.train_step(order[i:i + spec.batch_size])
            steps += 1
            log.info("sft %s epoch %d step %d: nll %.4f (%d samples)", agent, epoch + 1, steps,
                     metrics.get("nll", float("nan")), metrics["samples_trained"])
    after = mean_nll(policy, samples, spec.batch_size)
    path = policy.save_full(out_dir / f"v{policy.weight_version:05d}")  # under LoRA: the adapter merged in
    result = SftResult(agent=agent, dataset=spec.dataset, checkpoint=str(path.resolve()),
                       weight_version=policy.weight_version, samples=len(samples), steps=steps, nll_before=before,
                       nll_after=after, start_model=acfg.model_path, counts=counts,
                       seconds=time.perf_counter() - start,
                       lora=acfg.lora.model_dump() if acfg.lora is not None else None)
    (out_dir / "sft_report.json").write_text(json.dumps(result.to_json(), indent=1) + "\n")
    return result
