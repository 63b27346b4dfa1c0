"""Command-line flags generated from config dataclasses, and the executors' config
validation."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Literal

import pytest

from llamarl.app import errors
from llamarl.app import cli
from llamarl.app.config import GeneratorConfig, TrainerConfig, parse_levels
from llamarl.app.rl.warmstart import WarmStartConfig


@dataclass(kw_only=True)
class DemoConfig:
    """A config for testing the flag generator."""

    name: str
    """Required: no default."""
    steps: int = 3
    """How many steps
    to run (a docstring over two lines)."""
    lr: float = 0.5
    """Learning rate."""
    mode: Literal["fast", "slow"] = "fast"
    """How to go."""
    verbose: bool = False
    """Say more."""
    limit: int | None = None
    """Optional cap."""
    undocumented: int = 1

    def __post_init__(self) -> None:
        if self.steps < 0:
            raise ValueError(f"steps must be >= 0, got {self.steps}")


def _parse_demo(argv: list[str]) -> DemoConfig:
    (cfg,) = cli.parse(argv, DemoConfig)
    return cfg


def _actions(cls: type) -> dict[str, argparse.Action]:
    parser = argparse.ArgumentParser()
    cli.add_config_args(parser, cls)
    return {a.dest: a for a in parser._actions if a.dest != "help"}


def test_field_docs_are_the_docstrings_under_fields():
    docs = cli.field_docs(DemoConfig)
    assert docs["name"] == "Required: no default."
    assert docs["steps"] == "How many steps to run (a docstring over two lines)."
    assert "undocumented" not in docs


def test_flags_from_fields_with_docstring_help():
    actions = _actions(DemoConfig)
    assert set(actions) == {f.name for f in dataclasses.fields(DemoConfig)}
    assert actions["steps"].option_strings == ["--steps"]
    assert actions["steps"].help.startswith("How many steps to run")
    assert "(default: 3)" in actions["steps"].help
    assert actions["name"].required
    assert not actions["steps"].required


def test_help_output_lists_flags_and_docs(capsys):
    with pytest.raises(SystemExit) as exc:
        _parse_demo(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for text in ("--name", "--steps", "--lr", "--mode", "--verbose", "--no-verbose", "--limit",
                 "Learning rate.", "A config for testing the flag generator."):
        assert text in out


def test_values_are_typed_and_defaults_kept():
    cfg = _parse_demo(["--name", "x", "--steps", "7", "--lr", "1e-3", "--limit", "4"])
    assert cfg == DemoConfig(name="x", steps=7, lr=1e-3, limit=4)
    assert isinstance(cfg.steps, int) and isinstance(cfg.lr, float) and isinstance(cfg.limit, int)
    assert _parse_demo(["--name", "y"]) == DemoConfig(name="y")


def test_literal_choices_enforced(capsys):
    assert _parse_demo(["--name", "x", "--mode", "slow"]).mode == "slow"
    with pytest.raises(SystemExit) as exc:
        _parse_demo(["--name", "x", "--mode", "medium"])
    assert exc.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_bools_are_flag_and_no_flag():
    assert _parse_demo(["--name", "x", "--verbose"]).verbose is True
    assert _parse_demo(["--name", "x", "--no-verbose"]).verbose is False
    assert _parse_demo(["--name", "x"]).verbose is False


@pytest.mark.parametrize("argv, message", [
    (["--name", "x", "--steps", "-1"], "steps must be >= 0, got -1"),
    (["--steps", "1"], "--name"),  # required flag missing
    (["--name", "x", "--steps", "many"], "invalid int value"),
    (["--name", "x", "--colour", "red"], "unrecognized arguments: --colour"),
])
def test_errors_exit_2_with_the_message(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        _parse_demo(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_to_dict():
    assert cli.to_dict(DemoConfig(name="x"))["mode"] == "fast"


# ---- the executors' configs -------------------------------------------------------------


@pytest.mark.parametrize("cls", [TrainerConfig, GeneratorConfig, WarmStartConfig])
def test_every_config_field_is_documented_and_keyword_only(cls):
    docs = cli.field_docs(cls)
    for f in dataclasses.fields(cls):
        assert docs.get(f.name), f"{cls.__name__}.{f.name} has no docstring"
        assert f.kw_only
    cls()  # the defaults are valid


def test_trainer_and_generator_flags_parse_together():
    cfg, gen = cli.parse(["--steps", "5", "--loss", "ppo", "--normalize-std", "--temperature", "0.7",
                          "--top-p", "0.9", "--levels", "1,3"], TrainerConfig, GeneratorConfig)
    assert (cfg.steps, cfg.loss, cfg.normalize_std, cfg.levels) == (5, "ppo", True, "1,3")
    assert gen.temperature == 0.7
    assert cfg.eval_at(gen) == "fp32"  # the generators' precision by default
    assert TrainerConfig().eval_at(GeneratorConfig(gen_precision="bf16")) == "bf16"
    assert TrainerConfig(eval_precision="fp32").eval_at(GeneratorConfig(gen_precision="bf16")) == "fp32"
    step = cfg.step_config(gen)
    assert (step.loss, step.rho_max, step.normaliser, step.temperature, step.top_p) == (
        "ppo", cfg.rho_max, "token", 0.7, 0.9)


@pytest.mark.parametrize("argv, message", [
    (["--steps", "0"], "steps must be >= 1"),
    (["--eval-samples", "0"], "eval_samples must be >= 1"),
    (["--eval-precision", "fp16"], "invalid choice"),
    (["--group-size", "1"], "group_size must be >= 2"),
    (["--lr", "0"], "lr must be > 0, got 0.0"),
    (["--rho-max", "-2"], "rho_max must be > 0, got -2.0"),
    (["--max-staleness", "-1"], "max_staleness must be an int >= 0 or 'auto', got -1"),
    (["--max-staleness", "sometimes"], "--max-staleness: an int or 'auto', got 'sometimes'"),
    (["--max-staleness", "auto", "--staleness-cap", "0"], "staleness_cap must be >= 1"),
    (["--kl-coef", "-0.1"], "kl_coef must be >= 0"),
    (["--slot-deadline-s", "0"], "slot_deadline_s must be > 0"),
    (["--levels", "1,4"], "levels must be"),
    (["--loss", "grpo"], "invalid choice"),
    (["--normaliser", "batch"], "invalid choice"),
    (["--temperature", "0"], "temperature must be > 0"),
    (["--max-new-tokens", "0"], "max_new_tokens must be >= 1"),
    (["--top-p", "1.5"], "top_p must be in (0, 1]"),
    (["--gen-batch-prompts", "0"], "gen_batch_prompts must be >= 1"),
    (["--run-id", "../x"], "run_id must be one safe path component"),
    (["--run-id", "/tmp/x"], "run_id must be one safe path component"),
    (["--run-id", "a/b"], "run_id must be one safe path component"),
    (["--run-id", ".."], "run_id must be one safe path component"),
    (["--gen-precision", "int4"], "invalid choice"),
    (["--gen-decoder", "graphs"], "invalid choice"),
    (["--gen-decoder", "compiled", "--gen-precision", "int8"], "gen_decoder compiled runs fp32, bf16 and fp8"),
    (["--loss", "ppo", "--no-ratio-correction"], "--no-ratio-correction is AIPO's"),
])
def test_trainer_generator_validation_is_an_argparse_error(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.parse(argv, TrainerConfig, GeneratorConfig)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("kwargs", [dict(steps=0), dict(batch_size=0), dict(train_size=0), dict(eval_size=0),
                                    dict(shortcut_rate=1.5), dict(shortcut_rate=-0.1), dict(lr=0.0)])
def test_warmstart_config_validation(kwargs):
    with pytest.raises(ValueError):
        WarmStartConfig(**kwargs)


def test_warmstart_flags(capsys):
    (cfg,) = cli.parse(["--steps", "10", "--out", "/tmp/x", "--shortcut-rate", "0"], WarmStartConfig)
    assert (cfg.steps, cfg.out, cfg.shortcut_rate) == (10, "/tmp/x", 0.0)
    with pytest.raises(SystemExit) as exc:
        cli.parse(["--shortcut-rate", "2"], WarmStartConfig)
    assert exc.value.code == 2
    assert "shortcut_rate must be in [0, 1]" in capsys.readouterr().err


def test_parse_levels():
    assert parse_levels("1,2,3") == (1, 2, 3)
    assert parse_levels("2") == (2,)
    for bad in ("", "0", "1,,2", "1 2", "4", "1,2,"):
        with pytest.raises(ValueError, match="levels"):
            parse_levels(bad)


def test_configs_keyword_only():
    with pytest.raises(TypeError):
        TrainerConfig(10)  # type: ignore[misc]


def test_raising_parser_raises_config_error_and_says_flags_use_dashes():
    parser = cli.RaisingParser(prog="llamarl.app.roles.trainer")
    cli.add_config_args(parser, TrainerConfig)
    with pytest.raises(errors.ConfigError, match=r"llamarl.app.roles.trainer: unrecognized arguments: --group_size 4 "
                                              r"\(flags are spelled with dashes"):
        parser.parse_args(["--group_size", "4"])
    with pytest.raises(errors.ConfigError, match="invalid int value"):
        parser.parse_args(["--steps", "many"])


def test_an_unknown_flag_is_answered_with_the_closest_known_one_or_where_they_are_listed():
    parser = cli.RaisingParser(prog="llamarl.app.roles.trainer")
    cli.add_config_args(parser, TrainerConfig)
    with pytest.raises(errors.ConfigError) as err:
        parser.parse_args(["--kl-coeff", "0.1", "--group_size=4"])
    assert str(err.value).endswith("(did you mean --kl-coef, --group-size?)"), err.value
    with pytest.raises(errors.ConfigError) as err:
        parser.parse_args(["--learning-rate", "1e-4"])
    assert str(err.value) == ("llamarl.app.roles.trainer: unrecognized arguments: --learning-rate 1e-4 "
                              "(`python -m llamarl.app.roles.trainer --help` lists every flag)")


def test_the_commands_parser_suggests_too_and_exits_2_under_its_module_name(capsys):
    with pytest.raises(SystemExit) as ended:
        cli.parse(["--stepz", "3"], TrainerConfig, prog="python -m llamarl.app.roles.local")
    assert ended.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "python -m llamarl.app.roles.local: error: unrecognized arguments: --stepz 3 (did you mean --steps?)")
