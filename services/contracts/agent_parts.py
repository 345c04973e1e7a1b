"""The parts of an agent's config (docs/architecture.md §7): its algorithm, engines, devices, LoRA, layout, and
supervised training from a chat-format JSONL file (``sft``).

``services.contracts.config`` re-exports every name here; import them from there.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

PLUGIN_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
# the trainer's registry (services/training/algorithms) holds exactly these; plug-ins: package.module:Class
BUILTIN_ALGORITHMS = ("grpo", "dr_grpo", "ppo", "gspo", "cispo", "reinforce_pp", "reinforce_pp_baseline", "sft",
                      "dpo")


class Strict(BaseModel):
    """Every config section: unknown fields, lax coercion (``"1.0"`` for a number, ``"yes"`` for a bool)
    and non-finite floats (``.inf``, ``.nan``) are errors naming the field."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class AlgorithmConfig(Strict):
    """The agent's RL algorithm (``name``) and its hyper-parameters; unused ones are ignored by the others."""

    name: str = Field("grpo",
                      description="a built-in algorithm (grpo, dr_grpo, ppo, gspo, cispo, reinforce_pp, "
                                  "reinforce_pp_baseline, sft, dpo) or a plug-in package.module:Class")
    lr: float = Field(1e-3, gt=0, description="AdamW learning rate (the peak, with a scheduler)")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    clip_eps_low: float = Field(0.2, gt=0, le=1, description="ratio clip below 1 (PPO family, CISPO, GSPO)")
    clip_eps_high: float = Field(0.2, gt=0, description="ratio clip above 1 (PPO family, CISPO, GSPO)")
    epochs: int = Field(1, ge=1, description="passes over each batch")
    minibatches: int = Field(1, ge=1, description="optimizer steps per pass")
    max_grad_norm: float = Field(1.0, gt=0, description="global gradient-norm clipping")
    normalize_std: bool = Field(True, description="grpo/ppo/gspo/cispo: divide advantages by the group's std")
    credit: Literal["episode", "turn"] = Field(
        "episode", description="episode: one advantage for all of a sample's tokens (its reward against its group's); "
        "turn: each generated turn's tokens get their own, the turn's return-to-go (Sample.turn_rewards from that turn "
        "on) against the group's samples at the same turn (grpo, dr_grpo, ppo, reinforce_pp*, cispo)")
    gamma: float = Field(1.0, gt=0, le=1, description="credit: turn: the discount of the return-to-go, G_k = sum over "
                         "j >= k of gamma^(j-k) r_j (below 1, a reward earned sooner is worth more)")
    baseline: Literal["group", "value"] = Field(
        "group", description="credit: turn: what a turn's return-to-go is measured against. group: the group's "
        "samples at the same turn; value: first a learned value of the turn's state (a small head on the policy's "
        "detached last hidden state, trained on the group-centred returns; torch backend), then the group's residuals")
    value_lr: float = Field(3e-3, gt=0, description="baseline: value: the value head's AdamW learning rate")
    value_hidden: int = Field(64, ge=1, description="baseline: value: the value head's hidden width")
    dual_clip_c: float = Field(3.0, gt=1, description="ppo: dual-clip bound on negative-advantage tokens")
    norm_tokens: int = Field(0, ge=0, description="dr_grpo: loss = token sum / (sequences x norm_tokens); "
                                                   "0 = the batch's padded length")
    dpo_beta: float = Field(0.1, gt=0, description="dpo: the inverse temperature of the preference loss")
    sft_min_reward: float | None = Field(None, description="sft: train only on samples with reward >= this")
    kl_coef: float = Field(0.0, ge=0, description="> 0 adds a KL term to a frozen reference (the start weights)")
    kl_estimator: Literal["k1", "k2", "k3"] = Field("k3",
                                                    description="the KL estimator of kl_coef's term (k1, k2 or k3, as "
                                                                "in Schulman's note)")
    entropy_coef: float = Field(0.0, ge=0, description="> 0 adds an entropy bonus")
    tis: bool = Field(True, description="truncated importance sampling for samples older than the trainer")
    tis_cap: float = Field(2.0, ge=1, description="upper bound of the TIS weight")
    lr_scheduler: Literal["constant", "linear", "cosine"] = Field("constant",
                                                                  description="the learning-rate schedule over "
                                                                              "optimizer steps: constant, linear or "
                                                                              "cosine decay")
    warmup_steps: int = Field(0, ge=0, description="optimizer steps of linear warm-up from 0 to lr")
    stable_steps: int = Field(0, ge=0, description="linear/cosine: optimizer steps held at lr after warm-up, before "
                              "the decay starts (warm-up, stable, decay: the WSD schedule)")
    decay_steps: int = Field(1000, ge=1, description="linear/cosine: optimizer steps from the decay's start to min_lr")
    min_lr_ratio: float = Field(0.0, ge=0, le=1,
                                description="linear/cosine: the lr at the decay's end, as a fraction of lr")
    params: dict[str, Any] = Field(default_factory=dict, description="free-form settings for plug-in algorithms")

    @field_validator("name")
    @classmethod
    def _known(cls, v: str) -> str:
        if ":" in v:
            if not PLUGIN_PATH.match(v):
                raise ValueError(f"{v!r} is not a plug-in path of the form package.module:Class")
            return v
        if v not in BUILTIN_ALGORITHMS:
            raise ValueError(f"unknown algorithm {v!r}; available: {', '.join(BUILTIN_ALGORITHMS)} "
                             f"(or a plug-in package.module:Class)")
        return v

    @model_validator(mode="after")
    def _turn_credit_settings(self) -> AlgorithmConfig:
        if self.gamma < 1 and self.credit != "turn":
            raise ValueError("gamma < 1 discounts the return per turn: it needs credit: turn")
        if self.baseline == "value" and self.credit != "turn":
            raise ValueError("baseline: value measures each turn's return against its state's value: it needs "
                             "credit: turn")
        return self


class SGLangEngineConfig(Strict):
    """Arguments of ``python -m sglang.launch_server`` per engine (``engine: sglang``)."""

    tp_size: int = Field(1, ge=1, description="tensor parallelism of each SGLang engine (--tp-size)")
    mem_fraction_static: float = Field(0.85, gt=0, le=1,
                                       description="the GPU memory fraction SGLang reserves for weights and KV cache "
                                                   "(--mem-fraction-static)")
    base_gpu_id: int = Field(0, ge=0, description="engine i uses GPUs base_gpu_id + i*tp_size ...")
    extra_args: list[str] = Field(default_factory=list, description="appended to the launch_server command")


class DeviceConfig(Strict):
    """Where one part of an agent computes (docs/architecture.md §9). ``auto``: ``cuda`` when torch sees a GPU.

    For the embedded engine ``dtype`` is the weights' dtype; for the trainer the weights and AdamW stay
    float32 and ``bfloat16`` runs the forward and backward passes under autocast (mixed precision).
    ``cuda`` without a GPU fails at the process's start, naming the field."""

    device: Literal["auto", "cpu", "cuda"] = Field("cpu", description="cpu, cuda, or auto (cuda when torch sees a GPU)")
    dtype: Literal["float32", "bfloat16"] = Field("float32",
                                                  description="float32 or bfloat16 (engine: the weights' dtype; "
                                                              "trainer: autocast, weights and AdamW stay float32)")


class EmbeddedConfig(DeviceConfig):
    """The embedded engine: its device and dtype, and its prefix cache (services/inference/prefix_cache.py)."""

    prefix_cache_mb: float = Field(256.0, ge=0, description="KV cache of finished sequences kept for later "
                                   "prompts that extend them (an episode's next turn), least recently used "
                                   "evicted first; 0 = every turn prefills its whole prompt")
    step_delay_ms: float = Field(0.0, ge=0, le=60_000, description="a pause before every decode step: a "
                                 "deliberately slow engine, for fault drills and tests; 0 in real runs")


class TrainerConfig(DeviceConfig):
    """The trainer: its device and precision, activation checkpointing and micro-batches (torch backend)."""

    gradient_checkpointing: bool = Field(False, description="recompute each layer's activations in the "
                                         "backward pass instead of keeping them: less activation memory, "
                                         "about one more forward of compute")
    micro_batch_size: int | None = Field(None, ge=0, description="rows per forward + backward pass (torch "
                                         "backend): each minibatch runs in micro-batches of this many rows, each "
                                         "loss weighted by its share of the minibatch, the gradients accumulated "
                                         "into the minibatch's one optimizer step (the same update, with one "
                                         "micro-batch's activations and logits in memory at a time); null or 0: "
                                         "the whole minibatch in one pass")


class LoraConfig(Strict):
    """LoRA adapters (torch backend, peft) on a frozen base; each version goes to the engines as the adapter alone
    (PEFT format), loaded on their resident base (/load_lora_adapter) and named per request (lora_path)."""

    r: int = Field(8, ge=1, description="the adapters' rank")
    alpha: float = Field(16.0, gt=0, description="the LoRA scaling numerator (scale = alpha / r)")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapters' input")
    target_modules: list[str] = Field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
                                      min_length=1, description="the linear layers that get adapters (module names)")


class MegatronLayout(Strict):
    """Parallel layout of the megatron backend (world size = TP x PP x DP processes under torchrun)."""

    tensor_parallel: int = Field(1, ge=1,
                                 description="tensor-parallel size (TP); heads, key/value heads, ffn and vocab must "
                                             "divide by it")
    pipeline_parallel: int = Field(1, ge=1, description="pipeline-parallel size (PP); the layers must divide by it")
    data_parallel: int = Field(1, ge=1,
                               description="data-parallel size (DP); the only one available without a GPU (gloo)")


class ChatMessage(BaseModel):
    """A chat message: its role and its text."""

    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool"]
    content: str


class SftRecord(BaseModel):
    """One line of a chat-format JSONL file (``tandem collect`` writes them; TRL's and the Tinker cookbook's
    conversation files are read too): ``messages`` and, when present, ``reward``, ``agent``, ``weight_version``."""

    model_config = ConfigDict(extra="ignore")

    messages: list[ChatMessage] = Field(min_length=1)
    reward: float = Field(0.0, allow_inf_nan=False, description="the episode's reward (0 when the file has none)")
    agent: str | None = Field(None, description="the agent that played it; set: only that agent trains on it")
    weight_version: int = Field(0, ge=0, description="the weight version that played it")

    @model_validator(mode="after")
    def _a_reply_after_a_prompt(self) -> SftRecord:
        roles = [m.role for m in self.messages if m.role != "system"]
        if "assistant" not in roles:
            raise ValueError("no assistant message: nothing to learn")
        if roles[0] == "assistant":
            raise ValueError("the conversation opens with an assistant message; it needs a user message first")
        return self

    @classmethod
    def read_file(cls, path: str) -> list[SftRecord]:
        """Every record of a chat-format JSONL file; ValueError naming the line that is not one."""
        records = []
        try:
            lines = Path(path).read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"{path}: cannot read it as UTF-8 text: {exc}") from None
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                records.append(cls.model_validate_json(line))
            except ValidationError as exc:
                err = exc.errors()[0]
                where = ".".join(str(p) for p in err["loc"])
                raise ValueError(f"{path} line {n}: {where + ': ' if where else ''}{err['msg']}") from None
        if not records:
            raise ValueError(f"{path}: no records")
        return records


class SftSchedule(Strict):
    """How long supervised training on a file runs."""

    epochs: int = Field(1, ge=1, description="passes over the file's samples")
    max_samples: int | None = Field(None, ge=1, description="train on the first N of the file's samples (all: null)")
    batch_size: int = Field(8, ge=1, description="samples per training step (one weight version each)")


class SftDataConfig(SftSchedule):
    """``agents.X.sft``: supervised training from a chat-format JSONL file (``tandem sft``), tokenized with the
    agent's chat template; the loss covers only the assistant messages' tokens. Needs ``algorithm.name: sft``."""

    dataset: str = Field(description="a chat-format JSONL file (one {messages, reward?, agent?} per line), "
                         "checked line by line at start")

    @field_validator("dataset")
    @classmethod
    def _readable(cls, path: str) -> str:
        if not Path(path).is_file():
            raise ValueError(f"no such file: {path}")
        SftRecord.read_file(path)
        return path
