"""State that outlives one graph call (packed-sequence metadata cache, activation offload streams).

Empty until the runtime issue lands; listed here so the package layout is the one DESIGN.md fixes.
"""
