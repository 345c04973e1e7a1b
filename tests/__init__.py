"""Tandem's test suite: tests by cost in unit/, integration/ and e2e/; the shared helpers beside them."""
