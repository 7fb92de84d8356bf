"""Command-line flags generated from a stage's config dataclass (as TRL's ``HfArgumentParser`` does).

A config field ``x_y`` is the flag ``--x-y``; its ``field(metadata=...)`` says the rest:

* ``help``: the help text (the default is appended);
* ``type``: the argparse type (default: from the annotation: ``int``, :func:`finite_float`, ``str``);
* ``choices``, ``metavar``, ``flag`` (another flag name), ``dest``, ``action`` (an argparse action);
* ``negatable``: a bool field gets ``--x-y / --no-x-y`` instead of a store-true flag;
* ``cli: False``: the field has no flag.

Every generated flag defaults to :data:`argparse.SUPPRESS`, so that a namespace holds only the
flags given: :func:`given_values` then lets explicit flags override a preset's defaults.
:func:`config_argv` is the way back: the flags that make such a parser rebuild a config (to start
another process with the same settings).

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

ENGINE_CHOICES: tuple[str, ...] = ("on", "off")
"""``--engine``: judge the plans the staging engine executes (``on``, what ships) or the raw plans."""


def engine_on(value: str) -> bool:
    """Whether an ``engine`` setting (:data:`ENGINE_CHOICES`) puts the staging engine in."""
    return value == "on"


def engine_field(**metadata: Any) -> Any:
    """The ``engine`` setting of a gate, a GRPO gate or an evaluation (:data:`ENGINE_CHOICES`)."""
    return dataclasses.field(
        default="on",
        metadata={
            "help": "on: judge the plans the staging engine executes (server/staging_engine.py), beside the "
            "raw plans' figures; off: judge the raw plans",
            "choices": ENGINE_CHOICES,
            **metadata,
        },
    )


def add_engine_argument(parser: argparse.ArgumentParser) -> None:
    """``--engine on|off`` (default on) of a command that judges plans (:func:`engine_field`)."""
    parser.add_argument(
        "--engine",
        choices=ENGINE_CHOICES,
        default="on",
        help="on: judge the plans the staging engine executes (server/staging_engine.py), beside the raw "
        "plans' figures; off: judge the raw plans (default on)",
    )


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
        if not _has_flag(f):
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
        switch = _switch(f, hints)
        if switch is not None:
            kwargs["action"] = argparse.BooleanOptionalAction if switch == "negatable" else "store_true"
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
        parser.add_argument(_flag(f), **kwargs)
    return parser


def _has_flag(f: dataclasses.Field) -> bool:
    return f.metadata.get("cli", True) is not False


def _flag(f: dataclasses.Field) -> str:
    """A field's flag: ``x_y`` -> ``--x-y`` unless its metadata names another."""
    return f.metadata.get("flag", f"--{f.name.replace('_', '-')}")


def _switch(f: dataclasses.Field, hints: dict[str, Any]) -> str | None:
    """``"negatable"`` (``--x / --no-x``) or ``"store_true"`` for a bool field without an action of its
    own; None for a flag that takes a value."""
    if hints.get(f.name) is not bool or "action" in f.metadata:
        return None
    return "negatable" if f.metadata.get("negatable") else "store_true"


def config_argv(config: Any) -> list[str]:
    """The flags that make a parser of :func:`add_config_arguments` (for ``type(config)``) rebuild
    ``config``, written from the same field metadata the parser is built from.

    A negatable switch is ``--x`` or ``--no-x``, a store-true switch ``--x`` when set; a field collected
    from repeated ``NAME=VALUE`` flags (:class:`CollectPairs`) one ``--x=NAME=VALUE`` per entry; a list or
    tuple a comma list (:func:`name_list`, :func:`task_list`); any other value ``--x=str(value)`` (a
    float's ``str`` reads back exactly; ``=`` keeps a value starting with ``-`` a value). What no flag
    can say (a field without a flag, None, a store-true switch off, an empty collection) is left out, so
    the parser gives the field its default: where the value differs from the default, ValueError.
    """
    cls = type(config)
    defaults = cls()
    hints = typing.get_type_hints(cls)
    argv: list[str] = []
    for f in dataclasses.fields(cls):
        value, flag, switch = getattr(config, f.name), _flag(f), _switch(f, hints)
        empty = value is None or value is False or (isinstance(value, (dict, list, tuple)) and not value)
        if not _has_flag(f) or (empty and switch != "negatable"):
            if value != getattr(defaults, f.name):
                raise ValueError(f"{cls.__name__}.{f.name}={value!r} has no flag that says it")
        elif switch == "negatable":
            argv.append(flag if value else f"--no-{flag[2:]}")
        elif switch == "store_true":
            argv.append(flag)
        elif f.metadata.get("action") is CollectPairs:
            argv += [f"{flag}={name}={v}" for name, v in value.items()]
        elif isinstance(value, (list, tuple)):
            argv.append(f"{flag}={','.join(map(str, value))}")
        else:
            argv.append(f"{flag}={value}")
    return argv


def given_values(args: argparse.Namespace | dict, config_cls: type) -> dict[str, Any]:
    """The config fields among parsed flags (only those given: flags default to SUPPRESS)."""
    given = vars(args) if isinstance(args, argparse.Namespace) else dict(args)
    names = {f.name for f in dataclasses.fields(config_cls)}
    return {k: v for k, v in given.items() if k in names}


__all__ = [
    "ENGINE_CHOICES",
    "CollectPairs",
    "add_config_arguments",
    "add_engine_argument",
    "config_argv",
    "engine_field",
    "engine_on",
    "finite_float",
    "given_values",
    "name_list",
    "name_weight",
    "non_negative_int",
    "positive_int",
    "task_list",
]
