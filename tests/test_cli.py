"""The `kvatlas` dispatcher: one subcommand whose optional dependency is missing (even one it only
imports while declaring its flags) must not break the others, and says what is missing when run."""
from __future__ import annotations

import sys
import types

import pytest

from cli import main as cli


def test_a_subcommand_missing_a_dependency_leaves_the_others_working(monkeypatch, capsys) -> None:
    broken = types.ModuleType("kvatlas_test_broken_cmd")

    def add_arguments(parser) -> None:  # noqa: ANN001
        import kvatlas_no_such_dependency  # noqa: F401  (what cmd_relay does with nats-py)

    broken.add_arguments = add_arguments  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "kvatlas_test_broken_cmd", broken)
    monkeypatch.setitem(cli.SUBCOMMANDS, "broken", ("kvatlas_test_broken_cmd", "needs a missing package"))
    args = cli.build_parser().parse_args(["record", "--connect", "w0=tcp://127.0.0.1:1", "--out", "x.kvlog"])
    assert args.command == "record"
    assert cli.main(["broken"]) == 2
    assert "kvatlas_no_such_dependency" in capsys.readouterr().err


def test_every_subcommand_has_help(capsys) -> None:
    for name in cli.SUBCOMMANDS:
        with pytest.raises(SystemExit) as e:
            cli.main([name, "--help"])
        assert e.value.code == 0, name
        assert capsys.readouterr().out.startswith("usage: kvatlas " + name)
