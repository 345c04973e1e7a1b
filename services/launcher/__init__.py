"""The ``tandem`` CLI and the local launcher (not a service: it starts them)."""
