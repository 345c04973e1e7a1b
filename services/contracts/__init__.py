"""Shared contracts: message models, stream names, config models, serialisation.

Every service imports this package; it imports no service.
"""
