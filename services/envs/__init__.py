"""Environments (task code): episodes between named roles, loaded by name or package.module:Class."""
