"""``accelerate launch`` that accepts ``--dynamo_backend sloth``:

    python -m sloth.launch [accelerate launch's arguments] --dynamo_backend sloth train.py [its arguments]

Why plain ``accelerate launch --dynamo_backend sloth`` refuses the name (accelerate 1.15: "invalid choice:
'sloth'"): its command line checks the value against a fixed list (argparse ``choices`` built from
``accelerate.commands.config.config_utils.DYNAMO_BACKENDS``), and its launcher converts it with
``DynamoBackend(value.upper())``, both in the launching process, before any training process starts, so the ``import sloth`` that adds the name inside a training script comes too late.
This module is accelerate's own ``launch`` command run in a process where sloth has added ``SLOTH`` to both (the
enum: compiler/integrations/accelerate_name.py; the list: here). Each training process is then started by accelerate
with ``ACCELERATE_DYNAMO_BACKEND=SLOTH``, which its ``Accelerator`` reads through the same enum: the script must
``import sloth`` before it builds the ``Accelerator`` (as the Trainer recipe does). accelerate compiles the
prepared model with ``torch.compile(model, backend="sloth", ...)``.
"""
from __future__ import annotations

import sys

NAME = "SLOTH"


def add_to_accelerate_cli() -> None:
    """Make ``sloth`` one of accelerate's ``--dynamo_backend`` choices (the enum and the list both), in this
    process; a clear error where accelerate is missing or its internals differ."""
    from .compiler.integrations.accelerate_name import register_with_accelerate

    try:
        from accelerate.commands.config import config_utils
    except ImportError as exc:
        raise SystemExit(f"sloth.launch: accelerate is not installed ({exc})") from exc
    if not register_with_accelerate():
        raise SystemExit("sloth.launch: could not add 'sloth' to accelerate's DynamoBackend (see the log above)")
    backends = getattr(config_utils, "DYNAMO_BACKENDS", None)
    if not isinstance(backends, list):
        raise SystemExit("sloth.launch: accelerate.commands.config.config_utils.DYNAMO_BACKENDS is not a list in "
                         "this accelerate version; cannot add 'sloth' to its --dynamo_backend choices")
    if NAME not in backends:
        backends.append(NAME)  # in place: accelerate's launch module holds this same list object


def main(argv: list[str] | None = None) -> int:
    add_to_accelerate_cli()
    from accelerate.commands.launch import launch_command, launch_command_parser

    args = launch_command_parser().parse_args(sys.argv[1:] if argv is None else argv)
    launch_command(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
