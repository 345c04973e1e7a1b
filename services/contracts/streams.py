"""Stream and key names. Everything is namespaced by run: ``tandem:{run}:...``."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Streams:
    run: str

    def key(self, name: str) -> str:
        return f"tandem:{self.run}:{name}"

    def turns(self, agent: str) -> str:
        return self.key(f"turns:{agent}")

    def replies(self, coordinator: str) -> str:
        return self.key(f"replies:{coordinator}")

    def samples(self, agent: str) -> str:
        return self.key(f"samples:{agent}")

    def batches(self, agent: str) -> str:
        return self.key(f"batches:{agent}")

    def weights(self, agent: str) -> str:
        return self.key(f"weights:{agent}")

    @property
    def events(self) -> str:
        return self.key("events")

    @property
    def control(self) -> str:
        return self.key("control")

    @property
    def deadletter(self) -> str:
        return self.key("deadletter")

    # --- keys that hold durable state (not streams) -------------------------
    def done_set(self, stream: str, group: str) -> str:
        """Ids of messages whose effect is done, per consumer group (idempotency)."""
        return f"{stream}:done:{group}"

    def loaded_version(self, agent: str) -> str:
        return self.key(f"state:{agent}:loaded_version")

    def loaded_weights(self, agent: str) -> str:
        """The WeightsUpdate (JSON) last loaded on the agent's engines (the rollout resumes from it)."""
        return self.key(f"state:{agent}:loaded_weights")

    def published_version(self, agent: str) -> str:
        return self.key(f"state:{agent}:published_version")

    def buffer_samples(self, agent: str) -> str:
        return self.key(f"buffer:{agent}:samples")

    def buffer_group(self, agent: str, group_id: str) -> str:
        return self.key(f"buffer:{agent}:group:{group_id}")

    def buffer_ready(self, agent: str) -> str:
        return self.key(f"buffer:{agent}:ready")

    def trained_samples(self, agent: str) -> str:
        return self.key(f"trainer:{agent}:trained_samples")

    def train_log(self, agent: str) -> str:
        return self.key(f"trainer:{agent}:log")

    def restarts(self) -> str:
        """Hash: service name -> times the local launcher restarted it in this run (``tandem up``)."""
        return self.key("state:restarts")

    def episodes(self) -> str:
        return self.key("episodes")
