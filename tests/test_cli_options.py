"""The engine options as one group: a command names the options it takes, typer lists them where
the command's `config` parameter stands, and the command is given their EngineConfig."""

from __future__ import annotations

import pytest
import typer
from pagechat.cli.main import app
from pagechat.cli.options import ENGINE_OPTIONS, MODEL, engine_options
from pagechat.core.config import EngineConfig
from pagechat.core.errors import PagechatError
from typer.main import get_command
from typer.testing import CliRunner


def configured(*args: str) -> EngineConfig:
    """The EngineConfig a command taking every engine option is given for these arguments."""
    seen = []
    tiny = typer.Typer()

    @tiny.command()
    @engine_options(*ENGINE_OPTIONS)
    def show(name: str = "x", *, config: EngineConfig, last: bool = False) -> None:
        seen.append(config)

    result = CliRunner().invoke(tiny, list(args), catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return seen[0]


def test_defaults_are_engine_configs():
    assert configured() == EngineConfig()


def test_options_become_the_config():
    config = configured("--dtype", "float32", "--kv-memory", "1MiB", "--eager", "--threads", "2")
    assert (config.dtype, config.kv_memory, config.graphs, config.threads) == (
        "float32",
        2**20,
        False,
        2,
    )


def test_bad_option_is_the_configs_error():
    with pytest.raises(PagechatError, match="--preempt must be recompute or swap"):
        configured("--preempt", "never")


def test_unknown_option_name_is_refused():
    with pytest.raises(TypeError, match="no_such"):
        engine_options("dtype", "no_such")


def option_names(command: str) -> list[str]:
    return [p.name for p in get_command(app).commands[command].params]


def test_each_command_lists_its_engine_options_in_one_order_where_config_stands():
    order = list(ENGINE_OPTIONS)
    for command, last in (("generate", "as_json"), ("serve", "watch"), ("bench-kv", "as_json")):
        names = option_names(command)
        engine = [n for n in names if n in ENGINE_OPTIONS]
        assert engine == sorted(engine, key=order.index) and "config" not in names
        assert names[names.index(engine[-1]) + 1] == last  # in the place of `config`
    assert [n for n in option_names("eval") if n in ENGINE_OPTIONS] == list(MODEL)
