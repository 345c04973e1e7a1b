"""Whole runs: ``tandem up`` end to end, the compose run, the dashboard in a browser."""
