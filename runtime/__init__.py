"""State that outlives one graph call: activation offload (offload.py: side streams, the pinned host pool, the
reloads in flight between the ops the offload option puts into compiled graphs) and packed-sequence metadata
(packing.py: each token's document bounds, built once per batch inside the graph and read by every layer)."""
