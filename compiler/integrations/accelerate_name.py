"""``TrainingArguments(torch_compile_backend="sloth")``: the name made valid for accelerate.

transformers' Trainer hands the backend name to accelerate's ``TorchDynamoPlugin``, which converts it with
``DynamoBackend(name.upper())``, an enum of the backends accelerate knows; any other name fails there
("'SLOTH' is not a valid DynamoBackend", accelerate 1.15) before torch.compile, which would find sloth
through its entry point, is ever called. ``import sloth`` therefore adds a ``SLOTH`` member to that enum
(when accelerate is installed); accelerate then calls ``torch.compile(model, backend="sloth", mode=...)``
with the lower-cased value. Python has no public way to extend an enum, so the member is made the way
``enum`` makes its own (a ``str`` instance of the enum class with ``_name_`` and ``_value_``) and entered in
the enum's lookup tables; if that ever fails, sloth still imports, and only this name is missing.
"""
from __future__ import annotations

import importlib.util
import logging

log = logging.getLogger("sloth")

NAME = "SLOTH"


def register_with_accelerate() -> bool:
    """Make ``DynamoBackend("SLOTH")`` valid; True if it is (now or already), False without accelerate or if
    the enum could not be extended (logged)."""
    if importlib.util.find_spec("accelerate") is None:
        return False
    try:
        from accelerate.utils.dataclasses import DynamoBackend

        if NAME in DynamoBackend._value2member_map_:
            return True
        member = str.__new__(DynamoBackend, NAME)
        member._name_, member._value_ = NAME, NAME
        member.__objclass__ = DynamoBackend
        if hasattr(DynamoBackend, "_sort_order_"):
            member._sort_order_ = len(DynamoBackend._member_names_)
        DynamoBackend._member_map_[NAME] = member
        DynamoBackend._value2member_map_[NAME] = member
        DynamoBackend._member_names_.append(NAME)
        return DynamoBackend(NAME) is member
    except Exception as exc:  # an accelerate or Python whose enum internals differ: say so, import anyway
        log.warning("sloth: could not add 'sloth' to accelerate's DynamoBackend (%s: %s); "
                    "TrainingArguments(torch_compile_backend='sloth') will be refused by accelerate",
                    type(exc).__name__, exc)
        return False
