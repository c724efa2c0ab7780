"""The batched engine: its step, rows, protocols, sampler, prefix store, grammars, token trees."""
