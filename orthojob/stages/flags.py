"""Command-line flags generated from a stage's config dataclass (as TRL's ``HfArgumentParser`` does).

A config field ``x_y`` is the flag ``--x-y``; its ``field(metadata=...)`` says the rest:

* ``help``: the help text (the default is appended);
* ``type``: the argparse type (default: from the annotation: ``int``, :func:`finite_float`, ``str``);
* ``choices``, ``metavar``, ``flag`` (another flag name), ``dest``, ``action`` (an argparse action);
* ``negatable``: a bool field gets ``--x-y / --no-x-y`` instead of a store-true flag;
* ``cli: False``: the field has no flag.

Every generated flag defaults to :data:`argparse.SUPPRESS`, so that a namespace holds only the
flags given: :func:`given_values` then lets explicit flags override a preset's defaults.

The argument types (:func:`positive_int`, :func:`non_negative_int`, :func:`task_list`, ...) live
here too, so that a config module and the CLI share them without importing each other.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import typing
from collections.abc import Iterable
from typing import Any

from server.cases import TASK_IDS


def positive_int(value: str) -> int:
    n = int(value)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def non_negative_int(value: str) -> int:
    n = int(value)
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {n}")
    return n


def finite_float(value: str) -> float:
    x = float(value)
    if not math.isfinite(x):
        raise argparse.ArgumentTypeError(f"must be finite, got {value}")
    return x


def task_list(value: str) -> list[str]:
    """``all`` or a comma list of task ids."""
    if value == "all":
        return list(TASK_IDS)
    tasks = [t for t in value.split(",") if t]
    unknown = [t for t in tasks if t not in TASK_IDS]
    if unknown or not tasks:
        raise argparse.ArgumentTypeError(
            f"unknown task(s) {unknown}: use 'all' or a comma list of {TASK_IDS}"
        )
    return tasks


def name_list(value: str) -> list[str]:
    """A non-empty comma list of names (e.g. reward functions)."""
    names = [n.strip() for n in value.split(",") if n.strip()]
    if not names:
        raise argparse.ArgumentTypeError("expected a comma list of names")
    return names


def name_weight(value: str) -> tuple[str, float]:
    """``NAME=WEIGHT`` (e.g. ``format=2``)."""
    name, sep, number = value.partition("=")
    if not sep or not name.strip():
        raise argparse.ArgumentTypeError(f"expected NAME=WEIGHT (e.g. format=2), got {value!r}")
    return name.strip(), finite_float(number)


class CollectPairs(argparse.Action):
    """A repeatable ``NAME=VALUE`` flag collected into one dict."""

    def __call__(self, parser, namespace, values, option_string=None):
        pairs = dict(getattr(namespace, self.dest, None) or {})
        name, value = values
        pairs[name] = value
        setattr(namespace, self.dest, pairs)


def _type_of(annotation: Any) -> Any:
    """The argparse type of a field annotation (``int | None`` -> int; ``float`` -> finite_float)."""
    if isinstance(annotation, str):
        annotation = {"int": int, "float": float, "str": str, "bool": bool}.get(
            annotation.split("|")[0].strip()
        )
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if args:
        annotation = args[0]
    if annotation is float:
        return finite_float
    if annotation in (int, str):
        return annotation
    return None


def add_config_arguments(
    parser: argparse.ArgumentParser,
    config_cls: type,
    choices: dict[str, Iterable[str]] | None = None,
) -> argparse.ArgumentParser:
    """Add one flag per field of ``config_cls`` (module docstring); ``choices`` adds or replaces a
    field's choices (e.g. the preset names, which the config module does not know)."""
    defaults = config_cls()
    hints = typing.get_type_hints(config_cls)
    for f in dataclasses.fields(config_cls):
        meta = f.metadata
        if meta.get("cli", True) is False:
            continue
        default = getattr(defaults, f.name)
        help_text = meta.get("help", "")
        empty = default is None or default is False or (isinstance(default, (dict, list)) and not default)
        if meta.get("show_default") is True or (meta.get("show_default", True) and not empty):
            help_text = f"{help_text} (default {default})".strip()
        kwargs: dict[str, Any] = {"default": argparse.SUPPRESS, "help": help_text}
        if "dest" in meta:
            kwargs["dest"] = meta["dest"]
        elif "flag" in meta:
            kwargs["dest"] = f.name
        if hints.get(f.name) is bool and "action" not in meta:
            kwargs["action"] = argparse.BooleanOptionalAction if meta.get("negatable") else "store_true"
        else:
            if "action" in meta:
                kwargs["action"] = meta["action"]
            kind = meta.get("type", _type_of(hints.get(f.name)))
            if kind is not None and kind is not str:
                kwargs["type"] = kind
            for key in ("metavar",):
                if key in meta:
                    kwargs[key] = meta[key]
            options = (choices or {}).get(f.name, meta.get("choices"))
            if options is not None:
                kwargs["choices"] = (
                    sorted(options) if not isinstance(options, (list, tuple)) else list(options)
                )
        parser.add_argument(meta.get("flag", f"--{f.name.replace('_', '-')}"), **kwargs)
    return parser


def given_values(args: argparse.Namespace | dict, config_cls: type) -> dict[str, Any]:
    """The config fields among parsed flags (only those given: flags default to SUPPRESS)."""
    given = vars(args) if isinstance(args, argparse.Namespace) else dict(args)
    names = {f.name for f in dataclasses.fields(config_cls)}
    return {k: v for k, v in given.items() if k in names}


__all__ = [
    "CollectPairs",
    "add_config_arguments",
    "finite_float",
    "given_values",
    "name_list",
    "name_weight",
    "non_negative_int",
    "positive_int",
    "task_list",
]
