"""Drafters over the engine's rows: the shared draft loop, draft model, EAGLE head, lookup, suffix trees, MTAD's beams, length policies."""
