"""Shared contracts: message models, stream names, the flow and key tables, shared records, config models,
the control API's status (status.py), serialisation.

Every service imports this package; it imports no service.
"""
