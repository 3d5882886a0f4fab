"""Latency profiles for the simulator: ByteRobust's published figures, and trainguard's own measurements.

``byterobust(machines)`` takes every phase from BYTEROBUST.md (its section or table is in ``sources``);
where the paper gives no figure the value is marked ``assumption``. ``measured(machines)`` reads the
committed benchmark results (``bench/results/{detection,recovery,checkpoint}.json``) and maps metrics to
phases (the table below); those were measured on an emulated 4-machine job on 2 CPU cores, so the restart
is projected to the job's size with the growth per doubling of machines that ByteRobust's Table 7 shows for
hot updates (the one input of the measured profile that is not ours).

=================  ===========================================================================
phase              measured profile: metric (``<file>:<metric>``, medians)
=================  ===========================================================================
detection          ``detection:detect_s.<fault>`` + ``recovery:alert_to_diagnosis_s.<fault>``
diagnosis          ``recovery:localize_s.<fault>`` (crash: diagnose; nan - crash: alignment;
                   hang: analyze; slow: vote; bitflip: replay; user_error: rollback)
restart            ``recovery:resume_s.crash`` less its detection and localization, less
                   ``checkpoint:restore_s.memory``; + Table 7's growth to the job's size
restore            ``checkpoint:restore_s.memory``
swap               ``recovery:resume_s.gpu_lost`` less its own detection and localization, less
                   the crash's restart (0 when not larger)
reschedule         ``recovery:cold_requeue_s`` less the crash's restart
hot update         ``recovery:resume_s.user_error`` less its detection and localization, + growth
standby self-check ``recovery:cold_requeue.self_check_s``
checkpoint cost    ``checkpoint:device.step_overhead_ratio``
quorum (degrade)   ``replicas:survivor_stall_s`` (the surviving replica's stall when another died)
heal (degrade)     ``replicas:heal_s`` (a killed replica group back, healed from a live one)
=================  ===========================================================================
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from trainguard.operators.sim.model import Profile, SimError

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"
PROFILES = ("byterobust", "measured")

# ByteRobust Table 7 (16-GPU machines): requeue and hot update seconds by job size
TABLE7_MACHINES16 = (128, 256, 512, 1024)
TABLE7_REQUEUE_S = (454.0, 545.0, 635.0, 768.0)
TABLE7_HOT_UPDATE_S = (46.0, 51.0, 54.0, 65.0)
WARM_VS_REQUEUE = 10.87  # §6: warm standby is 10.87x faster than requeue
WARM_VS_RESCHEDULE = 5.36  # ... and 5.36x faster than rescheduling the evicted machines only
HUMAN_S = 5400.0  # §4.1: a manual hang diagnosis took more than 1.5 h
STEP_S = 10.0  # assumption: a training step of a 9,600-GPU job (checkpoint every step); unpublished
MEASURED_MACHINES = 4  # the recovery benchmark's job (TP=2 PP=2 DP=2 on m0..m3)


def _fit_log2(sizes: tuple[int, ...], values: tuple[float, ...]) -> tuple[float, float]:
    """Least-squares line of ``values`` over log2(``sizes``): (value at the mean size, growth per doubling)."""
    xs = [math.log2(s) for s in sizes]
    mx, my = sum(xs) / len(xs), sum(values) / len(values)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, values, strict=True)) / sum((x - mx) ** 2 for x in xs)
    return my - slope * mx, slope


def table7(machines: int, gpus_per_machine: int = 8) -> tuple[float, float, float]:
    """(requeue, hot update, hot-update growth per doubling) for a job of ``machines`` machines of
    ``gpus_per_machine`` GPUs, from Table 7's log-linear fit (its machines have 16 GPUs)."""
    x = math.log2(max(machines * gpus_per_machine / 16.0, 1.0))
    a_r, b_r = _fit_log2(TABLE7_MACHINES16, TABLE7_REQUEUE_S)
    a_h, b_h = _fit_log2(TABLE7_MACHINES16, TABLE7_HOT_UPDATE_S)
    return a_r + b_r * x, a_h + b_h * x, b_h


def byterobust(machines: int, gpus_per_machine: int = 8) -> Profile:
    """ByteRobust's published latencies for a job of ``machines`` machines."""
    requeue, hot, _ = table7(machines, gpus_per_machine)
    warm = requeue / WARM_VS_REQUEUE
    return Profile(
        name="byterobust",
        detect_s={"machine_fault": 10.0, "network": 30.0, "crash_transient": 10.0, "crash_machine": 10.0,
                  "user_code": 10.0, "hang": 600.0, "slow": 600.0, "nan": STEP_S, "sdc": STEP_S},
        diagnose_s={"diagnose": 83.0, "align": 4289.0 - 93.0, "analyze": 20.0, "vote": 50.0, "replay": 4289.0,
                    "rollback": 10.0},
        restart_s=hot, restore_s=0.0, swap_s=max(0.0, warm - hot), reschedule_s=warm * (WARM_VS_RESCHEDULE - 1),
        hot_update_s=57.0, human_s=HUMAN_S, step_s=STEP_S, checkpoint_overhead=1 / (1 - 0.0071) - 1,
        provision_s=600.0,
        sources={
            "detect.machine_fault": "Table 3: GPU lost / driver hang 10 s",
            "detect.network": "Table 3: NIC crash, port flapping 30 s",
            "detect.crash": "assumption: 10 s (the GPU checks' interval); Table 6 gives 93 s for a CUDA error "
                            "in all, the rest is diagnosis",
            "detect.hang": "§4.1: zero RDMA traffic for 10 min starts the aggregation analysis",
            "detect.slow": "assumption: the same 10 min as a hang (low tensor-core utilisation)",
            "detect.nan/sdc": "§4.1: NaN in loss is a fault signal: one step (step time is an assumption)",
            "diagnose.diagnose": "Table 6: CUDA error resolved in 93 s, less 10 s detection",
            "diagnose.align": "Table 6: NaN resolved in 4,289 s, less the crash diagnosis",
            "diagnose.analyze": "Mycroft: root cause within 20 s in 60% of cases (companions)",
            "diagnose.vote": "§5: rounds every 10 s, 5 rounds",
            "diagnose.replay": "assumption: as long as a NaN's resolution (Table 6, 4,289 s)",
            "diagnose.rollback": "assumption: 10 s to read the logs",
            "restart": "Table 7: hot update, log-linear fit over 128-1,024 16-GPU machines",
            "swap": "§6: warm standby 10.87x faster than requeue (Table 7's requeue fit), less the restart",
            "reschedule": "§6: warm standby 5.36x faster than rescheduling the evicted machines",
            "hot_update": "Table 6: code/data adjustment 57 s",
            "human": "§4.1: a manual hang diagnosis took more than 1.5 h",
            "checkpoint": "Table 8: MFU loss 0.71% with per-step checkpoints",
            "provision": "assumption: 10 min of pod init and self-check before a standby parks",
            "step": "assumption: 10 s step, a checkpoint every step (§6.3)",
        })


def _metrics(results: Path, name: str) -> dict[str, Any]:
    path = results / f"{name}.json"
    try:
        return json.loads(path.read_text())["metrics"]
    except (OSError, ValueError, KeyError) as exc:
        raise SimError(f"the measured profile needs {path} ({type(exc).__name__}); run bench/{name}.py or use "
                       f"--profile byterobust") from None


def _m(doc: dict[str, Any], key: str, file: str) -> float:
    m = doc.get(key)
    if not isinstance(m, dict) or not isinstance(m.get("median", m.get("value")), int | float):
        raise SimError(f"bench/results/{file}.json has no metric {key!r}; rerun bench/{file}.py")
    return float(m.get("median", m.get("value")))


def measured(machines: int, results: Path | None = None, gpus_per_machine: int = 8) -> Profile:
    """trainguard's own latencies, read from the committed benchmark results, for a job of ``machines``."""
    results = results or RESULTS
    det, rec, ck = (_metrics(results, n) for n in ("detection", "recovery", "checkpoint"))
    fault = {"machine_fault": ("gpu_lost", "gpu_lost"), "network": ("nic_down", "nic_down"),
             "crash_transient": ("crash", "crash"), "crash_machine": ("crash", "crash"),
             "user_code": ("user_error", "user_error"), "hang": ("hang_collective", "hang"), "slow": ("slow", "slow"),
             "nan": ("nan", "nan"), "sdc": ("sdc", "sdc")}
    detect = {k: _m(det, f"detect_s.{d}", "detection") + _m(rec, f"alert_to_diagnosis_s.{r}", "recovery")
              for k, (d, r) in fault.items()}

    def restart_part(d: str, r: str) -> float:
        return (_m(rec, f"resume_s.{r}", "recovery") - _m(det, f"detect_s.{d}", "detection")
                - _m(rec, f"alert_to_diagnosis_s.{r}", "recovery") - _m(rec, f"localize_s.{r}", "recovery"))

    restore = _m(ck, "restore_s.memory", "checkpoint")
    crash_part = max(restart_part("crash", "crash"), restore)
    _, _, growth = table7(machines, gpus_per_machine)
    grow = growth * max(0.0, math.log2(machines / MEASURED_MACHINES))
    loc = {r: _m(rec, f"localize_s.{r}", "recovery") for r in ("crash", "nan", "hang", "slow", "bitflip", "user_error")}
    rep = _metrics(results, "replicas")
    quorum = _m(rep, "survivor_stall_s", "replicas")
    heal = _m(rep, "heal_s", "replicas")
    return Profile(
        name="measured", detect_s=detect,
        diagnose_s={"diagnose": loc["crash"], "align": max(0.0, loc["nan"] - loc["crash"]), "analyze": loc["hang"],
                    "vote": loc["slow"], "replay": loc["bitflip"], "rollback": loc["user_error"]},
        restart_s=crash_part - restore + grow, restore_s=restore,
        swap_s=max(0.0, restart_part("gpu_lost", "gpu_lost") - crash_part),
        reschedule_s=max(0.0, _m(rec, "cold_requeue_s", "recovery") - crash_part),
        hot_update_s=max(0.0, restart_part("user_error", "user_error")) + grow, human_s=HUMAN_S, step_s=STEP_S,
        checkpoint_overhead=_m(ck, "device.step_overhead_ratio", "checkpoint"),
        provision_s=_m(rec, "cold_requeue.self_check_s", "recovery"), quorum_s=quorum, heal_s=heal,
        sources={"all": "bench/results/*.json medians (operators/sim/profiles.py maps metric to phase)",
                 "degrade": "replicas:survivor_stall_s (the replica that did not fail stood still: each of the "
                            "two quorum changes) and replicas:heal_s (a killed replica group restarted, healed "
                            "from the live one and trained again), trainguard.replicas on this host",
                 "restart growth": f"Table 7: +{growth:.1f} s per doubling of machines from the measured "
                                   f"{MEASURED_MACHINES} to {machines} (+{grow:.0f} s)",
                 "human": "§4.1: a manual hang diagnosis took more than 1.5 h",
                 "step": "assumption: 10 s step, a checkpoint every step"})


def profile(name: str, machines: int, *, results: Path | None = None, gpus_per_machine: int = 8) -> Profile:
    if name == "byterobust":
        return byterobust(machines, gpus_per_machine)
    if name == "measured":
        return measured(machines, results, gpus_per_machine)
    raise SimError(f"unknown profile {name!r}; use one of {', '.join(PROFILES)}")
