"""Turning on a transformers model's activation checkpointing under either of its names.

transformers 5.2x renamed ``gradient_checkpointing_enable`` / ``_disable`` to ``activation_checkpointing_*``;
the old names warn and go in v6, and the device's transformers 5.17 has only them. The tests call these helpers, so a fresh install of whichever
transformers PyPI serves keeps passing.
"""
from __future__ import annotations

from typing import Optional

import torch


def enable_checkpointing(model: torch.nn.Module, use_reentrant: Optional[bool] = None) -> None:
    """``model.activation_checkpointing_enable()`` where transformers has it, else the old name; with
    ``use_reentrant`` passed on to torch.utils.checkpoint when given."""
    kwargs = None if use_reentrant is None else {"use_reentrant": use_reentrant}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def disable_checkpointing(model: torch.nn.Module) -> None:
    """``model.activation_checkpointing_disable()`` where transformers has it, else the old name."""
    if hasattr(model, "activation_checkpointing_disable"):
        model.activation_checkpointing_disable()
    else:
        model.gradient_checkpointing_disable()
