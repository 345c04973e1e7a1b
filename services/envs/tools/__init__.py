"""Tools an agent can call in the middle of its turn (calculator, Python REPL, scratch files, search)."""
