"""The simulator's inputs: the failure model (what fails, how often, how it behaves) and a latency profile
(how long each phase of the control plane's response takes), both plain data with their sources.

The default failure model is ``failure_model.yaml`` beside this module (each number cites BYTEROBUST.md);
``load_model(path)`` merges a user's YAML or JSON file over it. Bad input (an unknown key, a negative rate,
shares that do not sum to a positive number) raises :class:`SimError`: one line saying what is wrong and
what to do, exit code 2 on the command line.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from trainguard.core.errors import TrainguardError

DEFAULT_MODEL = Path(__file__).with_name("failure_model.yaml")
DAY_S = 86400.0


class SimError(TrainguardError):
    """Bad simulator input (one line: what is wrong and what to do); exit code 2."""

    def __init__(self, message: str) -> None:
        super().__init__(message, exit_code=2)


@dataclass(frozen=True)
class FailureKind:
    """One kind of failure. ``share``: its weight among failures; ``alert``: the alert kind the node agent
    raises for it (what the real triage reads); ``machine_fault``: one machine is the cause and stays faulty
    until evicted; ``recall``: chance the stop-time diagnosis flags that machine; ``recur_p``: for a fault with
    no machine to blame, the chance that a machine the diagnosis cannot see is the cause after all (it comes
    back and the ladder climbs); ``log_verdict``: what the logs say (``user_code``: the job's own code);
    ``repeat_p``: for network faults, the chance the link flaps again within the repeat window."""

    name: str
    share: float
    alert: str
    machine_fault: bool = False
    recall: float = 1.0
    recur_p: float = 0.0
    log_verdict: str = ""
    repeat_p: float = 0.0


@dataclass(frozen=True)
class FailureModel:
    """Rates are per 8-GPU machine and day (``gpus_per_machine`` says the machine size they are for);
    see ``failure_model.yaml`` for each field's source."""

    rate_per_machine_day: float
    gpus_per_machine: int
    weak_machine_share: float
    weak_rate_multiplier: float
    repair_days: float
    manual_share: float
    manual_urgent_share: float
    kinds: tuple[FailureKind, ...]
    recur_after_s: float = 600.0  # a fault left in place shows again after this long on average (assumption)

    def shares(self) -> dict[str, float]:
        total = sum(k.share for k in self.kinds)
        return {k.name: k.share / total for k in self.kinds}

    def with_rate(self, rate: float) -> FailureModel:
        return FailureModel(**{**{f.name: getattr(self, f.name) for f in fields(self)}, "rate_per_machine_day": rate})


_TOP = {f.name for f in fields(FailureModel)}
_KIND = {f.name for f in fields(FailureKind)} - {"name"}
_ALERTS = {"gpu_lost", "gpu_ecc", "gpu_xid", "disk_full", "rank_exit", "kernel_oom", "rank_hang", "rank_stopped",
           "rank_slow", "nan_loss", "sdc_suspect", "nic_down", "nic_errors"}


def _merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _merge(dict(out[key]), value)
        else:
            out[key] = value
    return out


def read_document(path: Path) -> dict[str, Any]:
    """A YAML or JSON file as a mapping (JSON is YAML too, but its errors read better from json)."""
    import yaml

    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise SimError(f"cannot read model file {path}: {exc.strerror}; give a readable YAML or JSON file") from None
    try:
        doc = json.loads(text) if str(path).endswith(".json") else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise SimError(f"model file {path} is not valid {'JSON' if str(path).endswith('.json') else 'YAML'}: "
                       f"{first}; fix its syntax") from None
    if not isinstance(doc, Mapping):
        raise SimError(f"model file {path} must hold a mapping of keys ({', '.join(sorted(_TOP))})")
    return dict(doc)


def _number(where: str, value: Any, *, low: float = 0.0, high: float = math.inf) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise SimError(f"{where} is {value!r}; give a number")
    if not low <= value <= high:
        bound = f"between {low:g} and {high:g}" if high < math.inf else f"{low:g} or more"
        raise SimError(f"{where} is {value!r}; it must be {bound}")
    return float(value)


def build_model(doc: Mapping[str, Any], *, origin: str = "model") -> FailureModel:
    """A validated :class:`FailureModel` from a complete document (the default file merged with overrides)."""
    unknown = sorted(set(doc) - _TOP)
    if unknown:
        raise SimError(f"{origin}: unknown key {unknown[0]!r}; the keys are {', '.join(sorted(_TOP))}")
    missing = sorted(_TOP - set(doc) - {"recur_after_s"})
    if missing:
        raise SimError(f"{origin}: key {missing[0]!r} is missing; add it (see operators/sim/failure_model.yaml)")
    kinds_doc = doc["kinds"]
    if not isinstance(kinds_doc, Mapping) or not kinds_doc:
        raise SimError(f"{origin}: kinds must map each failure kind to its fields ({', '.join(sorted(_KIND))})")
    kinds = []
    for name, spec in kinds_doc.items():
        if spec is None:
            continue  # a kind set to null in an override is left out
        if not isinstance(spec, Mapping):
            raise SimError(f"{origin}: kinds.{name} must be a mapping of {', '.join(sorted(_KIND))}")
        bad = sorted(set(spec) - _KIND)
        if bad:
            raise SimError(f"{origin}: kinds.{name} has unknown key {bad[0]!r}; its keys are "
                           f"{', '.join(sorted(_KIND))}")
        alert = str(spec.get("alert", ""))
        if alert not in _ALERTS:
            raise SimError(f"{origin}: kinds.{name}.alert {alert!r} is not an alert kind the simulator raises; "
                           f"use one of {', '.join(sorted(_ALERTS))}")
        verdict = str(spec.get("log_verdict", ""))
        if verdict not in ("", "user_code", "infrastructure"):
            raise SimError(f"{origin}: kinds.{name}.log_verdict {verdict!r} must be user_code, infrastructure or empty")
        kinds.append(FailureKind(
            name=str(name), share=_number(f"{origin}: kinds.{name}.share", spec.get("share", 0.0)), alert=alert,
            machine_fault=bool(spec.get("machine_fault", False)),
            recall=_number(f"{origin}: kinds.{name}.recall", spec.get("recall", 1.0), high=1.0),
            recur_p=_number(f"{origin}: kinds.{name}.recur_p", spec.get("recur_p", 0.0), high=1.0),
            log_verdict=verdict,
            repeat_p=_number(f"{origin}: kinds.{name}.repeat_p", spec.get("repeat_p", 0.0), high=1.0)))
    if sum(k.share for k in kinds) <= 0:
        raise SimError(f"{origin}: the kinds' shares sum to 0; give at least one kind a positive share")
    gpm = doc["gpus_per_machine"]
    if isinstance(gpm, bool) or not isinstance(gpm, int) or gpm < 1:
        raise SimError(f"{origin}: gpus_per_machine is {gpm!r}; give a positive integer")
    return FailureModel(
        rate_per_machine_day=_number(f"{origin}: rate_per_machine_day", doc["rate_per_machine_day"], high=10.0),
        gpus_per_machine=gpm,
        weak_machine_share=_number(f"{origin}: weak_machine_share", doc["weak_machine_share"], high=1.0),
        weak_rate_multiplier=_number(f"{origin}: weak_rate_multiplier", doc["weak_rate_multiplier"], low=1.0),
        repair_days=_number(f"{origin}: repair_days", doc["repair_days"]),
        manual_share=_number(f"{origin}: manual_share", doc["manual_share"], high=0.99),
        manual_urgent_share=_number(f"{origin}: manual_urgent_share", doc["manual_urgent_share"], high=1.0),
        kinds=tuple(kinds),
        recur_after_s=_number(f"{origin}: recur_after_s", doc.get("recur_after_s", 600.0), low=1.0))


def load_model(path: Path | None = None, overrides: Mapping[str, Any] | None = None) -> FailureModel:
    """The default model, with ``path``'s keys (YAML or JSON) and then ``overrides`` merged over it."""
    doc = read_document(DEFAULT_MODEL)
    origin = "operators/sim/failure_model.yaml"
    if path is not None:
        user = read_document(path)
        unknown = sorted(set(user) - _TOP)
        if unknown:
            raise SimError(f"model file {path}: unknown key {unknown[0]!r}; the keys are {', '.join(sorted(_TOP))}")
        doc, origin = _merge(doc, user), f"model file {path}"
    if overrides:
        doc = _merge(doc, overrides)
    return build_model(doc, origin=origin)


@dataclass(frozen=True)
class Profile:
    """How long each phase of the response takes, in seconds, for a job of ``machines`` machines.

    ``detect_s``: fault -> incident opened, per failure kind; ``diagnose_s``: per ladder action (diagnose:
    stop-time diagnosis; align: NaN's alignment test on top; analyze: stacks; vote: the fail-slow rounds;
    replay: dual-phase replay; rollback: reading logs and switching the revision); ``restart_s``: stopping
    and restarting the job in place; ``restore_s``:
    loading the checkpoint; ``swap_s``: activating warm standbys on top of a restart; ``reschedule_s``: on
    top of a restart when the pool lacks standbys (the shortfall is rescheduled); ``hot_update_s``: a manual
    code change applied in place; ``human_s``: an incident that waits for a human; ``step_s``: the training
    step (checkpoint interval: every step); ``checkpoint_overhead``: step time with checkpoints over without,
    minus 1; ``provision_s``: a new standby's self-check before it parks; ``sources``: where each came from;
    the degrade path's (``--degrade``): ``quorum_s``, the other replicas' stall at a change of the replicas
    that train (a replica leaves, a healed one rejoins), and ``heal_s``, a replacement catching up from a
    live replica before it rejoins.
    A profile is built for one job size (:mod:`trainguard.operators.sim.profiles`): restarts grow with the machines."""

    name: str
    detect_s: Mapping[str, float]
    diagnose_s: Mapping[str, float]
    restart_s: float
    restore_s: float
    swap_s: float
    reschedule_s: float
    hot_update_s: float
    human_s: float
    step_s: float
    checkpoint_overhead: float
    provision_s: float
    sources: Mapping[str, str] = field(default_factory=dict)
    quorum_s: float = 0.0
    heal_s: float = 0.0
