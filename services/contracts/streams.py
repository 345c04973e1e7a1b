"""Stream and key names. Everything is namespaced by run: ``tandem:{run}:...``. Which service writes and
reads a key that several share, and its values' model: the key table (contracts/keys.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Streams:
    run: str

    def key(self, name: str) -> str:
        return f"tandem:{self.run}:{name}"

    def name_of(self, stream: str) -> str:
        """The flow-table name of one of this run's streams (``tandem:{run}:turns:A`` -> ``turns``)."""
        prefix = self.key("")
        if not stream.startswith(prefix):
            raise ValueError(f"{stream!r} is not a stream of run {self.run!r}")
        return stream[len(prefix):].split(":", 1)[0]

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

    def loaded_weight_version(self, agent: str) -> str:
        """The weight version loaded on the agent's engines (held under the key ``loaded_version``)."""
        return self.key(f"state:{agent}:loaded_version")

    def loaded_weights(self, agent: str) -> str:
        """The WeightsUpdate (JSON) last loaded on the agent's engines (the rollout resumes from it)."""
        return self.key(f"state:{agent}:loaded_weights")

    def engine_adapters(self, agent: str) -> str:
        """The adapter versions (JSON list of KeptAdapter) every engine serving the agent must hold; written by a
        rollout that shares another agent's engines, read by that fleet's rollout to restore a restarted engine."""
        return self.key(f"state:{agent}:engine_adapters")

    def published_weight_version(self, agent: str) -> str:
        """The last weight version the agent's trainer committed (held under ``published_version``, as above)."""
        return self.key(f"state:{agent}:published_version")

    def buffer_samples(self, agent: str) -> str:
        return self.key(f"buffer:{agent}:samples")

    def buffer_group(self, agent: str, group_id: str) -> str:
        return self.key(f"buffer:{agent}:group:{group_id}")

    def buffer_ready(self, agent: str) -> str:
        return self.key(f"buffer:{agent}:ready")

    def buffer_verdicts(self, agent: str) -> str:
        """Group id -> the buffer's verdict on it (``records.Verdict``: "kept", "dropped:<reason>",
        "abandoned:<reason>")."""
        return self.key(f"buffer:{agent}:verdicts")

    def groups_pending(self, agent: str) -> str:
        """Sorted set: groups the coordinator emitted to the agent's buffer, scored by emission time; the
        buffer removes a group when it records its verdict, and abandons one left past the group timeout."""
        return self.key(f"groups:{agent}:pending")

    def group_ledger(self, agent: str) -> str:
        """Hash: group id -> the coordinator's JSON record of the agent's part of the group (``records.LedgerEntry``;
        its owner: coordinator/ledger.py). Once emitted it holds the ids of the samples, written in the transaction
        that publishes them; the buffer reads the membership and size of a group from it, never from a sample's
        own claim (docs/architecture.md §2.3, §10)."""
        return self.key(f"coord:ledger:{agent}")

    def batches_released(self, agent: str) -> str:
        """Counter: batches the buffer released for the agent (the next batch trains towards this + 1); the
        trainer counts a batch it skipped (non-finite step) back down, so the buffer releases one in its place."""
        return self.key(f"buffer:{agent}:released")

    def skipped_batches(self, agent: str) -> str:
        """Hash: batch id -> JSON record of a training step the trainer skipped (non-finite), kept once."""
        return self.key(f"trainer:{agent}:skipped_batches")

    def nonfinite_in_row(self, agent: str) -> str:
        """Counter: training steps skipped as non-finite since the last committed one (a restart keeps it)."""
        return self.key(f"trainer:{agent}:nonfinite_in_row")

    def trained_samples(self, agent: str) -> str:
        return self.key(f"trainer:{agent}:trained_samples")

    def train_log(self, agent: str) -> str:
        return self.key(f"trainer:{agent}:log")

    def restarts(self) -> str:
        """Hash: service name -> times the local launcher restarted it in this run (``tandem up``)."""
        return self.key("state:restarts")

    def episodes(self) -> str:
        return self.key("episodes")

