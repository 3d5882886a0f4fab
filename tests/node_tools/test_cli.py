"""tg-node prints one JSON document and exits 0/2; errors are one line in {"error": ...}."""

from __future__ import annotations

import json

import pytest

from trainguard.node_tools import cli
from trainguard.node_tools.config import NodeConfig


@pytest.fixture
def node(tmp_path, monkeypatch):
    cfg = NodeConfig(machine="m7", workdir=tmp_path / "disk", install_dir=tmp_path, gpus=2,
                     nvml_backend="emulated", nvml_state=tmp_path / "nvml.json", fault_file=tmp_path / "faults.json")
    cfg.save(tmp_path / "node.json")
    monkeypatch.setenv("TG_NODE_CONFIG", str(tmp_path / "node.json"))
    return cfg


def run(capsys, *argv):
    code = cli.main(list(argv))
    out = capsys.readouterr().out
    assert out.count("\n") == 1
    return code, json.loads(out)


def test_info_and_gpu(node, capsys):
    assert run(capsys, "info") == (0, node.to_dict())
    code, snap = run(capsys, "gpu")
    assert code == 0 and snap["backend"] == "emulated" and snap["device_count"] == 2


@pytest.mark.parametrize(
    "argv,match",
    [
        (["job", "start", "--job", "x"], "the following arguments are required"),
        (["job", "status", "--job", "a b; rm -rf /"], "job name 'a b; rm -rf /' must be"),
        (["job", "steps", "--job", "j", "--rank", "0"], "has no rank 0 of job j"),
        (["fault", "inject", "--kind", "slow", "--param", "x"], "must be written key=value"),
        (["fault", "inject", "--kind", "hang"], "no job is running on machine m7"),
        (["fault", "inject", "--kind", "nic_down"], "inject it from the host"),
        (["fault", "inject", "--kind", "xid", "--param", "gpu=5"], "has GPUs 0..1; there is no GPU 5"),
        (["fault", "inject", "--kind", "disk_full", "--rank", "1"], "acts on a whole machine"),
        (["bogus"], "invalid choice"),
        (["job", "start", "--job", "x", "--nnodes", "1", "--node-rank", "0", "--nproc-per-node", "1", "--master-addr",
          "127.0.0.1", "--master-port", "29500", "--entry", "t.py", "--hang-floor-s", "0.1"],
         "--hang-floor-s 0.1 must be 0.5..3600 seconds"),
    ],
)
def test_bad_input_is_a_one_line_json_error_with_exit_2(node, capsys, argv, match):
    code, doc = run(capsys, *argv)
    assert code == 2 and match in doc["error"] and "\n" not in doc["error"]
    # and nothing was recorded
    assert not (node.fault_file.with_name("faults.ledger.json")).exists()


def test_job_status_of_an_unknown_job_is_absent(node, capsys):
    assert run(capsys, "job", "status", "--job", "nope")[1]["state"] == "absent"
    assert run(capsys, "job", "stop", "--job", "nope")[1]["stopped_pids"] == []


def test_fault_injection_is_off_without_a_fault_file(tmp_path, monkeypatch, capsys):
    NodeConfig(machine="real", workdir=tmp_path, install_dir=tmp_path).save(tmp_path / "n.json")
    monkeypatch.setenv("TG_NODE_CONFIG", str(tmp_path / "n.json"))
    code, doc = run(capsys, "fault", "inject", "--kind", "disk_full")
    assert code == 2 and "fault injection is off" in doc["error"]


def test_a_job_nice_outside_0_to_19_is_a_one_line_error(tmp_path, monkeypatch, capsys):
    raw = NodeConfig(machine="n1", workdir=tmp_path, install_dir=tmp_path, job_nice=10).to_dict()
    (tmp_path / "n.json").write_text(json.dumps(raw | {"job_nice": 25}))
    monkeypatch.setenv("TG_NODE_CONFIG", str(tmp_path / "n.json"))
    code, doc = run(capsys, "info")
    assert code == 2 and "job_nice 25 is outside 0..19" in doc["error"]
    (tmp_path / "n.json").write_text(json.dumps(raw))
    assert run(capsys, "info") == (0, raw)


def test_missing_nvml_is_exit_2_and_the_agent_runs_without_gpu_checks(tmp_path, monkeypatch, capsys):
    cfg = NodeConfig(machine="g1", workdir=tmp_path / "disk", install_dir=tmp_path, gpus=8, nvml_backend="real",
                     bus_url=f"spool://{tmp_path / 'bus'}", kmsg_path=tmp_path / "kmsg")
    cfg.workdir.mkdir()
    (tmp_path / "kmsg").write_text("")
    cfg.save(tmp_path / "node.json")
    monkeypatch.setenv("TG_NODE_CONFIG", str(tmp_path / "node.json"))
    try:
        import pynvml

        pynvml.nvmlInit()
        pytest.skip("this machine has a working NVML")
    except Exception:
        pass
    code, doc = run(capsys, "gpu")
    assert code == 2 and "NVML could not start" in doc["error"]
    code, doc = run(capsys, "agent", "--once")
    assert code == 0 and "gpu" not in doc["checks"]
    assert any(n.startswith("gpu:") and "8 GPUs expected" not in n for n in doc["notes"])


def test_clearing_a_gpu_fault_empties_the_emulated_kernel_log(tmp_path, monkeypatch, capsys):
    cfg = NodeConfig(machine="k1", workdir=tmp_path / "disk", install_dir=tmp_path, gpus=2, nvml_backend="emulated",
                     nvml_state=tmp_path / "nvml.json", fault_file=tmp_path / "faults.json",
                     kmsg_path=tmp_path / "kmsg")
    cfg.workdir.mkdir()
    (tmp_path / "kmsg").write_text("")
    cfg.save(tmp_path / "node.json")
    monkeypatch.setenv("TG_NODE_CONFIG", str(tmp_path / "node.json"))
    assert run(capsys, "fault", "inject", "--kind", "xid")[0] == 0
    assert "NVRM: Xid" in (tmp_path / "kmsg").read_text()
    code, report = run(capsys, "check", "host")
    assert code == 1 and [f["kind"] for f in report["findings"]] == ["kernel_xid"]
    assert run(capsys, "fault", "clear")[0] == 0
    assert (tmp_path / "kmsg").read_text() == ""
    assert run(capsys, "check", "all")[0] == 0


def test_os_errors_are_one_line_json(node, capsys, monkeypatch):
    from trainguard.node_tools import job

    def full(*_a, **_k):
        raise OSError(28, "No space left on device", "/disk/jobs/x/job.json")

    monkeypatch.setattr(job, "status", full)
    code, doc = run(capsys, "job", "status", "--job", "x")
    assert code == 2 and doc["error"] == "No space left on device (/disk/jobs/x/job.json)"


def test_ctrl_c_is_exit_130_with_a_one_line_error(node, capsys, monkeypatch):
    """docs/reference/cli.md documents 130 for an interrupted command, everywhere; tg-node answered 2."""
    from trainguard.node_tools import job

    def interrupted(*_a, **_k):
        raise KeyboardInterrupt

    monkeypatch.setattr(job, "status", interrupted)
    assert run(capsys, "job", "status", "--job", "x") == (130, {"error": "interrupted"})


def test_job_output_gives_each_rank_s_last_lines_and_where_its_file_is(node, capsys):
    """Where a job's stdout went was written nowhere: 'tg-node job output' (and 'trainguard job logs' over it)
    says, rank by rank."""
    from trainguard.node_tools import monitor

    rd = node.workdir / "jobs" / "team"
    (rd / "ranks").mkdir(parents=True)
    logs = rd / "logs" / "inc2"
    for local, rank in ((0, 4), (1, 5)):
        d = logs / "none_abc" / "attempt_0" / str(local)
        d.mkdir(parents=True)
        (d / "stdout.log").write_text("".join(f"rank {rank} line {i}\n" for i in range(80)))
        (d / "stderr.log").write_text(f"rank {rank} warning\n")
        monitor.write_json_atomic(monitor.heartbeat_path(rd, rank), {"rank": rank, "local_rank": local,
                                                                     "incarnation": 2})
    monitor.write_json_atomic(rd / "job.json", {"job": "team", "incarnation": 2, "log_dir": str(logs)})
    code, doc = run(capsys, "job", "output", "--job", "team", "--tail", "3")
    assert code == 0 and doc["incarnation"] == 2 and [r["rank"] for r in doc["ranks"]] == [4, 5]
    assert doc["ranks"][1]["lines"] == ["rank 5 line 77", "rank 5 line 78", "rank 5 line 79"]
    assert doc["ranks"][0]["path"].endswith("inc2/none_abc/attempt_0/0/stdout.log")
    code, doc = run(capsys, "job", "output", "--job", "team", "--rank", "4", "--stream", "stderr")
    assert [r["lines"] for r in doc["ranks"]] == [["rank 4 warning"]]
    code, doc = run(capsys, "job", "output", "--job", "nosuch")
    assert code == 2 and "has no job nosuch" in doc["error"]
