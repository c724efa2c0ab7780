"""Acceptance rules: exact, lossy, the cascades' deferral rules."""
