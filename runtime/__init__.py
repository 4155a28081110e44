"""State that outlives one graph call: activation offload (offload.py: side streams, the pinned host pool, the
reloads in flight between the ops the offload option puts into compiled graphs); packed-sequence metadata is
planned."""
