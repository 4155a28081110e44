"""Graph side of sloth: the backend entry, canonicalisation, the pass pipeline and the report."""
