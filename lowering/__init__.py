"""Fused ops: one file per op, each with its Triton kernels, launchers, registration and public function.

Ops register with ``torch.library`` lazily (``register()`` in each file, called once by the pass that
inserts the op), so importing sloth defines functions and registers nothing.
"""
