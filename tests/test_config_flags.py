"""Flags generated from a config dataclass and back: :func:`orthojob.stages.flags.config_argv` writes what
:func:`orthojob.stages.flags.add_config_arguments`'s parser reads, for every kind of field."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field

import pytest

from orthojob.stages.flags import (
    CollectPairs,
    add_config_arguments,
    config_argv,
    given_values,
    name_list,
    name_weight,
)


@dataclass(frozen=True)
class _Settings:
    out: str = "runs/x"
    steps: int = 3
    lr: float = 1e-3
    model: str | None = None
    rewards: list[str] | None = field(default=None, metadata={"type": name_list})
    weights: dict[str, float] = field(
        default_factory=dict, metadata={"type": name_weight, "action": CollectPairs, "flag": "--weight"}
    )
    verbose: bool = False
    safe: bool = field(default=True, metadata={"negatable": True})
    kind: str = field(default="a", metadata={"choices": ("a", "b")})
    hidden: int = field(default=0, metadata={"cli": False})


def _rebuilt(config):
    parser = add_config_arguments(argparse.ArgumentParser(), type(config))
    return type(config)(**given_values(parser.parse_args(config_argv(config)), type(config)))


def test_every_kind_of_field_comes_back_through_the_flags():
    """Strings (one starting with '-'), ints, floats to the last digit, optionals set and unset, a comma
    list, repeated NAME=VALUE pairs, store-true and negatable switches both ways, a choice."""
    assert _rebuilt(_Settings()) == _Settings()
    away = _Settings(out="-odd name", steps=-2, lr=1 / 3, model="m", rewards=["a", "b"],
                     weights={"task_hard": 2.5, "format": 1 / 7}, verbose=True, safe=False, kind="b")  # fmt: skip
    argv = config_argv(away)
    assert "--rewards=a,b" in argv and argv.count("--weight=task_hard=2.5") == 1 and "--no-safe" in argv
    assert _rebuilt(away) == away


def test_a_value_no_flag_can_say_is_refused_unless_it_is_the_default():
    """A field without a flag, or set to None / an empty collection / a store-true switch off where
    its default differs, would come back as the default: ValueError, naming the field."""
    assert "--hidden" not in " ".join(config_argv(_Settings(hidden=0)))
    with pytest.raises(ValueError, match=r"_Settings\.hidden=5"):
        config_argv(_Settings(hidden=5))

    @dataclass(frozen=True)
    class OnByDefault:
        on: bool = True
        name: str | None = "x"

    with pytest.raises(ValueError, match=r"OnByDefault\.on=False"):
        config_argv(OnByDefault(on=False))
    with pytest.raises(ValueError, match=r"OnByDefault\.name=None"):
        config_argv(OnByDefault(name=None))


def test_the_training_job_config_comes_back_through_its_own_parser():
    """``orthojob grpo``'s parser (preset names as choices) rebuilds its config from config_argv."""
    from orthojob.stages.grpo import add_train_arguments, config_from_args
    from orthojob.stages.grpo_config import GRPOJobConfig

    config = dataclasses.replace(GRPOJobConfig(), steps=7, lr=1 / 3, level_weights={"task_hard": 2.0},
                                 rewards=["reward_terminal", "reward_format"], mixed_cells=True, from_checkpoint="ckpt")  # fmt: skip
    parser = add_train_arguments(argparse.ArgumentParser())
    assert config_from_args(parser.parse_args(config_argv(config))) == config
