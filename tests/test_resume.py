"""The one resume rule (eyas.resume), and that every stage's config is under it."""

from __future__ import annotations

from dataclasses import fields

import pytest

from eyas.errors import EXIT_USAGE, exit_code
from eyas.resume import ResumeRefused, ResumeRule

RULE = ResumeRule(
    may_change=frozenset({"batch"}), per_invocation=frozenset({"rank"}), before={"loss": "kl"}
)


def test_a_resume_keeps_the_saved_config_and_takes_what_may_change():
    saved = {"lr": 3e-3, "batch": 8, "rank": 1}  # written before `loss` existed
    got = RULE.resume(saved, {"batch": 16, "rank": 0}, "t/train.json")
    assert got == {"lr": 3e-3, "batch": 16, "rank": 0, "loss": "kl"}
    assert RULE.resume(saved, {}, "t") == {"lr": 3e-3, "batch": 8, "loss": "kl"}  # rank: not saved
    assert RULE.stored({"lr": 1, "rank": 3}) == {"lr": 1}


def test_a_fixed_field_given_another_value_is_refused_naming_both():
    with pytest.raises(ResumeRefused) as e:
        RULE.resume({"lr": 3e-3}, {"lr": 1e-3, "loss": "kl"}, "t/train.json")
    msg = str(e.value)
    assert msg.startswith("t/train.json: --lr 0.003 saved, 0.001 given") and "cannot change" in msg
    assert "--loss" not in msg  # the value a directory of before `loss` was made with
    assert exit_code(e.value) == EXIT_USAGE


def test_a_whole_config_against_a_saved_one():
    assert RULE.differences({"lr": 1, "batch": 8}, {"lr": 1, "batch": 4, "loss": "kl"}) == []
    assert RULE.differences({"lr": 1, "old": 2}, {"lr": 2, "loss": "lk"}) == [
        "--loss kl saved, lk given",
        "--lr 1 saved, 2 given",
        "--old 2 saved, an option this eyas does not have",
    ]


@pytest.mark.parametrize(
    "stage, config",
    [
        ("eyas.stages.extract", "eyas.stages.extract:ExtractConfig"),
        ("eyas.stages.train", "eyas.training.config:TrainConfig"),
    ],
)
def test_every_field_a_rule_names_is_a_field_of_its_config(stage, config):
    """A field renamed in the config but not in its rule would silently become fixed."""
    import importlib

    rule = importlib.import_module(stage).RESUME_RULE
    mod, cls = config.split(":")
    names = {f.name for f in fields(getattr(importlib.import_module(mod), cls))}
    named = rule.may_change | rule.per_invocation | rule.before.keys()
    assert named and named <= names, sorted(named - names)


def test_every_kind_rule_names_only_its_own_options_and_a_resume_keeps_them():
    """Over the kind registry: the names a kind's options give the resume rule are its own
    fields; a training saved before kinds owned their options (every kind's fields in one
    flat config) is read back with its own kind's alone, and a change of one of them is
    refused naming both values."""
    from eyas.drafters import KINDS, option_owners, options_class
    from eyas.training.config import TrainConfig, resume_rule, saved_flat

    every_kind = {name: None for name in option_owners()}
    for name in KINDS:
        own = options_class(name)
        names = {f.name for f in fields(own)}
        assert own.may_change | own.before.keys() <= names, name
        cfg = TrainConfig.of(data="d", out="o", kind=name)
        old = {**every_kind, **cfg.flat()}  # what an older eyas wrote: all kinds' options
        assert saved_flat(old) == cfg.flat()
        rule = resume_rule(name)
        assert rule.differences(saved_flat(old), cfg.flat()) == []
        fixed = next(f for f in fields(own) if rule.fixed(f.name) and isinstance(f.default, int))
        with pytest.raises(ResumeRefused, match=f"--{fixed.name.replace('_', '-')} "):
            rule.resume(saved_flat(old), {fixed.name: fixed.default + 1}, "t/train.json")
