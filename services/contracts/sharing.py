"""Agents whose rollouts share one engine fleet (``agents.B.share_engines_with: A``): the check and the groups.

A sharing agent's turns run on the owner's engines: one base, loaded once, and each agent's LoRA adapters on
it, named per request. The owner's rollout starts and supervises the fleet; a sharing agent's rollout drives
the owner's router as an external router and loads, names and records only its own adapters
(docs/architecture.md §2.3).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def sharing_problem(agents: Mapping[str, Any]) -> str | None:
    """Why the agents' ``share_engines_with`` choices cannot run (the message names the field), or None."""
    for name, acfg in agents.items():
        owner = acfg.share_engines_with
        if owner is None:
            continue
        field = f"agents.{name}.share_engines_with"
        if owner == name:
            return f"{field}: an agent cannot share its own engines"
        if owner not in agents:
            return f"{field}: names agent {owner!r}, which is not under agents ({', '.join(agents)})"
        host = agents[owner]
        if host.share_engines_with is not None:
            return (f"{field}: agent {owner!r} itself shares agent {host.share_engines_with!r}'s engines; name the "
                    "agent that owns the fleet (no chains)")
        if acfg.model_path != host.model_path:
            return f"{field}: model_path {acfg.model_path!r} differs from {owner!r}'s {host.model_path!r} (one base)"
        if acfg.engine != host.engine:
            return f"{field}: engine {acfg.engine!r} differs from {owner!r}'s {host.engine!r}"
        if acfg.lora is None or host.lora is None:
            return f"{field}: both {name!r} and {owner!r} must train with lora (adapters on the shared base)"
        if acfg.engine == "sglang" and (acfg.lora.r > host.lora.r or
                                        not set(acfg.lora.target_modules) <= set(host.lora.target_modules)):
            return (f"{field}: lora r {acfg.lora.r} and target_modules must fit {owner!r}'s (its SGLang engines "
                    "declare the adapters' largest rank and their modules at launch)")
    return None


def fleet_owner(agents: Mapping[str, Any], agent: str) -> str:
    """The agent whose fleet serves ``agent``'s turns (itself unless it shares another's engines)."""
    return agents[agent].share_engines_with or agent


def sharers(agents: Mapping[str, Any], owner: str) -> list[str]:
    """The agents whose rollouts drive ``owner``'s fleet besides ``owner`` (their adapters live on it too)."""
    return [name for name, acfg in agents.items() if acfg.share_engines_with == owner]
