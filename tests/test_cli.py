"""The trainguard command line: what its help promises exists."""

from __future__ import annotations

import json

from node_tools import faults
from operators.cli import main


def test_inject_list_names_every_fault_kind_its_help_points_to(capsys):
    """``trainguard inject --help`` pointed to an ``inject --list`` that did not exist."""
    assert main(["inject", "--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == list(faults.FAULT_KINDS)
    assert main(["--json", "inject", "--list"]) == 0
    kinds = json.loads(capsys.readouterr().out)
    assert {k["kind"]: k["target"] for k in kinds} == {n: f.target for n, f in faults.FAULT_KINDS.items()}
    assert {k["kind"]: k["params"] for k in kinds}["slow"] == {"seconds": 0.5}


def test_inject_without_a_machine_is_one_line_and_exit_2(capsys, tmp_path):
    assert main(["--state-dir", str(tmp_path), "inject", "--fault", "crash"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "trainguard: inject needs --machine NAME (or --list for the fault kinds)"
