"""Whole operations on files, as the CLI runs them: build, validate, reshard."""
