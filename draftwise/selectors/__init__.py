"""The select phase: Speculative Verification, its profiles, SmartSpec, staged companions."""
