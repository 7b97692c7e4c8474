"""The only code that touches other frameworks' internals (transformers' quantizer registry, its start-up scan)."""
