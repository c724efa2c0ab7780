"""Draftwise inside other servers: the vLLM proposer."""
