"""Demonstrations: a model role's turns written by its environment's ``demonstration`` instead of a model.

``tandem collect --demonstrate ROLE`` seats the role's agent as usual (its tokenizer and chat template render
the view, its tools run) but answers each generation with what the environment says a competent player writes
(a tool call, then the answer after its result): chat-format trajectories that show a start model a protocol
it never uses on its own, for SFT before RL (docs/guides/tools.md). The reply is the text's tokens plus the
end-of-turn token, logprobs 0, weight version 0, engine ``demonstration``; one longer than the agent's
``sampling.max_new_tokens`` is refused (the model could not write it, and would learn a reply cut short).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from services.contracts.messages import GenerateReply, GenerateRequest
from services.contracts.players import Player
from services.envs.base import Environment

ENGINE = "demonstration"


class Demonstrator:
    """Answers generations of the episodes it was shown (``show``) from their environments."""

    def __init__(self, tokenizers: Mapping[Player, Any]) -> None:
        self.tokenizers = tokenizers
        self.envs: dict[str, Environment] = {}
        self.steps: dict[tuple[str, str, int], int] = {}  # (episode, role, turn) -> generations so far

    def show(self, episode_id: str, env: Environment) -> None:
        self.envs[episode_id] = env

    def forget(self, episode_id: str) -> None:
        self.envs.pop(episode_id, None)
        self.steps = {k: v for k, v in self.steps.items() if k[0] != episode_id}

    async def generate(self, player: Player, request: GenerateRequest) -> GenerateReply:
        env = self.envs[request.episode_id]
        key = (request.episode_id, request.role, request.turn)
        step = self.steps.get(key, 0)
        self.steps[key] = step + 1
        text = env.demonstration(request.role, step)
        tok = self.tokenizers[player]
        ids = list(tok.encode(text, add_special_tokens=False)) + [tok.eos_token_id]
        if len(ids) > request.sampling.max_new_tokens:  # a reply the model could not write in its budget
            agent = getattr(player, "agent", request.agent)
            raise ValueError(f"the demonstration of role {request.role!r} takes {len(ids)} tokens with its end of "
                             f"turn, more than agents.{agent}.sampling.max_new_tokens "
                             f"({request.sampling.max_new_tokens})")
        return GenerateReply(request_id=request.id, agent=request.agent, episode_id=request.episode_id,
                             turn=request.turn, output_ids=ids, output_logprobs=[0.0] * len(ids),
                             finish_reason="stop", weight_version=0, engine=ENGINE,
                             prompt_tokens=len(request.input_ids))


def check_demonstrated(env_cls: type[Environment], model_roles: set[str], roles: list[str]) -> None:
    """``--demonstrate`` roles must be model roles of the config that the environment can demonstrate."""
    for role in roles:
        if role not in model_roles:
            raise ValueError(f"--demonstrate {role}: not a role an agent plays here (agents play: "
                             f"{', '.join(sorted(model_roles)) or 'none'})")
        if role not in env_cls.demonstrated_roles:
            raise ValueError(f"--demonstrate {role}: environment {env_cls.env_name} cannot demonstrate it "
                             f"(it demonstrates: {', '.join(env_cls.demonstrated_roles) or 'none'})")
