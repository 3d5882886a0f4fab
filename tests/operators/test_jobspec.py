"""A job's spec (trainguard.operators.jobspec): read from YAML or JSON with one-line errors naming the field, the
layout derived when it is data parallel only, stored in the fleet database, and what every launch and restart
runs: the user's own command, working directory, arguments and environment, never the reference job."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.fakes import alert, fleet_controller, run_incident
from trainguard.core.topology import Topology
from trainguard.operators.jobspec import REFERENCE_ENTRY, JobSpecError, load_spec, parse_spec, reference_spec

BASE = {"name": "team-llm", "command": ["train.py", "--lr", "3e-4"], "machines": 4}


def test_a_data_parallel_job_needs_no_layout():
    spec = parse_spec(BASE | {"processes_per_machine": 2})
    assert spec.topology() == Topology(1, 1, 8, ranks_per_machine=2)
    assert (spec.entry, spec.args, spec.module) == ("train.py", ["--lr", "3e-4"], "")
    assert spec.launch_args() == ["--lr", "3e-4"]  # no --tp/--pp/--dp unless asked


def test_a_layout_is_checked_against_the_ranks_and_passed_when_asked():
    spec = parse_spec(BASE | {"processes_per_machine": 2, "layout": {"tp": 2, "pp": 2}, "pass_layout": True})
    assert spec.topology() == Topology(2, 2, 2, ranks_per_machine=2)
    assert spec.launch_args()[-6:] == ["--tp", "2", "--pp", "2", "--dp", "2"]


def test_a_module_and_a_command_string():
    spec = parse_spec(BASE | {"command": "-m team.train --config 'a b.yaml'"})
    assert (spec.module, spec.entry, spec.args) == ("team.train", "team.train", ["--config", "a b.yaml"])


@pytest.mark.parametrize(("change", "message"), [
    ({"name": None}, r"^job spec: name is missing; add it$"),
    ({"name": "bad name!"}, r"^job spec: name: must be 1-64 letters, digits or -_\. starting with a letter or digit$"),
    ({"command": []}, r"^job spec: command: List should have at least 1 item"),
    ({"command": ["--lr", "1"]}, r"^job spec: command: starts with the option '--lr'; name the script"),
    ({"command": ["-m"]}, r"^job spec: command: -m must be followed by a module name"),
    ({"command": "train.py 'unclosed"}, r"^job spec: command: cannot be split into words"),
    ({"machines": 0}, r"^job spec: machines: a count must be 1\.\.100000$"),
    ({"machines": ["m1", "m2", "m1"]}, r"^job spec: machines: names m1 twice; list each machine once$"),
    ({"env": {"RANK": "3"}}, r"^job spec: env: RANK is set by the launch itself; remove it$"),
    ({"env": {"TG_JOB": "x"}}, r"^job spec: env: TG_JOB is set by the launch itself; remove it$"),
    ({"env": {"A-B": "x"}}, r"^job spec: env: 'A-B' is not a variable name"),
    ({"layout": {"tp": 3}}, r"^job spec: layout tp=3 x pp=1 does not divide the 4 ranks \(4 machines x 1 processes\)$"),
    ({"layout": {"tp": 2, "dp": 4}}, r"^job spec: layout dp=4 but 4 ranks / \(tp=2 x pp=1\) = 2; leave dp out"),
    ({"launcher": "direct", "processes_per_machine": 2}, r"^job spec: launcher direct starts one process a machine"),
    ({"launcher": "mpirun"}, r"^job spec: launcher: Input should be 'torchrun' or 'direct'"),
    ({"revision": "a b"}, r"^job spec: revision: must be 1-128 letters"),
    ({"hang_floor_s": 0.1}, r"^job spec: hang_floor_s: Input should be greater than or equal to 0\.5$"),
    ({"gpus": 8}, r"^job spec: gpus is not a field of a job spec; remove it \(fields: name, command, "),
])
def test_a_bad_spec_is_one_line_naming_the_field(change, message):
    doc = {k: v for k, v in (BASE | change).items() if v is not None}
    with pytest.raises(JobSpecError, match=message) as info:
        parse_spec(doc)
    assert "\n" not in str(info.value) and info.value.exit_code == 2


def test_a_spec_file_in_yaml_or_json_and_what_is_wrong_with_a_file(tmp_path: Path):
    y = tmp_path / "job.yaml"
    y.write_text("name: a\ncommand: [train.py]\nmachines: [m1, m2]\nenv: {NCCL_DEBUG: WARN}\n")
    assert load_spec(y).machines == ["m1", "m2"] and load_spec(y).env == {"NCCL_DEBUG": "WARN"}
    j = tmp_path / "job.json"
    j.write_text('{"name": "a", "command": ["train.py"], "machines": 2}')
    assert load_spec(j).machine_count == 2
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\n")
    with pytest.raises(JobSpecError, match=rf"^job spec {bad}: not valid YAML \("):
        load_spec(bad)
    with pytest.raises(JobSpecError, match=r"cannot be read \(No such file or directory\); give the path"):
        load_spec(tmp_path / "none.yaml")
    listed = tmp_path / "list.yaml"
    listed.write_text("- name: a\n")
    with pytest.raises(JobSpecError, match=r"must be a mapping of fields \(name, command, machines, \.\.\.\), "
                                           r"not list"):
        load_spec(listed)


def test_the_reference_job_is_a_spec_like_any_other():
    spec = reference_spec("demo", Topology(2, 2, 2), train_args=["--checkpoint"])
    assert spec.entry == REFERENCE_ENTRY and spec.pass_layout and spec.is_reference
    assert spec.keeps_checkpoints(["--checkpoint"]) and not spec.keeps_checkpoints([])
    assert spec.remote_url(["--checkpoint-s3", "s3://b/p"]) == "s3://b/p"
    user = parse_spec(BASE | {"checkpoint": "s3://ckpt/team"})
    assert not user.is_reference and user.keeps_checkpoints([]) and user.remote_url([]) == "s3://ckpt/team"
    assert parse_spec(BASE | {"checkpoint": "/local/{machine}"}).remote_url([]) == ""


def test_a_restart_after_a_fault_runs_the_users_own_command_arguments_and_environment(tmp_path, monkeypatch):
    spec = parse_spec({"name": "j", "command": ["-m", "team.train", "--data", "shards/*.bin", "--lr", "0.1"],
                       "workdir": "/srv/team", "machines": ["m0", "m1", "m2", "m3"], "processes_per_machine": 2,
                       "env": {"NCCL_DEBUG": "WARN", "HF_HOME": "/srv/cache dir"}, "checkpoint": "s3://ckpt/j",
                       "hang_floor_s": 8})
    c, fleet = fleet_controller(tmp_path, topology=spec.topology(), train_args=spec.args, spec=spec.document())
    assert c.fleet.job("j").spec == spec.document()
    out = run_incident(c, [alert("gpu_lost", "m1")], monkeypatch)
    assert out["closed"]["state"] == "resolved"
    starts = [argv for _m, argv in fleet.commands if argv[:2] in (["job", "start"], ["standby", "activate"])]
    assert len(starts) == 4  # every machine restarted, the swapped-in standby included
    for argv in starts:
        head, tail = argv[:argv.index("--")], argv[argv.index("--") + 1:]
        assert head[head.index("--entry") + 1] == "team.train" and "--module" in head
        assert head[head.index("--workdir") + 1] == "/srv/team"
        assert head[head.index("--checkpoint") + 1] == "s3://ckpt/j"
        assert head[head.index("--hang-floor-s") + 1] == "8"  # the agents' floor the job asked for
        assert sorted(a for a in head if a.startswith("--env=")) == ["--env=HF_HOME=/srv/cache dir",
                                                                      "--env=NCCL_DEBUG=WARN"]
        assert tail == ["--data", "shards/*.bin", "--lr", "0.1"]  # the user's arguments, nothing of the example's
        assert REFERENCE_ENTRY not in argv and "--tp" not in argv
    assert "m1" not in c.fleet.job("j").machine_list


def test_a_job_recorded_without_a_spec_is_the_reference_job(tmp_path):
    c, _fleet = fleet_controller(tmp_path, train_args=["--checkpoint"])
    stored = parse_spec(c.fleet.job("j").spec)
    assert stored.is_reference and stored.args == ["--checkpoint"] and stored.topology() == Topology(1, 2, 2)
