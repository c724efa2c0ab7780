"""Trained heads: EAGLE, EAGLE-3, their export, SPRINTER's verifier."""
