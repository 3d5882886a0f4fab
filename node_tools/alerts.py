"""The alert: what a machine's agent tells the control plane, as versioned JSON.

One alert is one JSON object::

    {"schema": 1, "id": "3f2c...", "job": "demo", "machine": "m2", "rank": 5,
     "kind": "rank_exit", "severity": "fault", "ts": 1795250046.7,
     "evidence": {"pid": 20059, "returncode": -9, "log_tail": ["..."]},
     "agent_version": "0.1.0"}

``rank`` is null for machine-level alerts, ``job`` is "" when no job is
concerned. It is validated with a JSON Schema on both ends: by the agent before
it publishes and by every reader before it acts. Readers refuse alerts of an
unknown schema version or from an agent of another major version. (A quick check
accepts the common, plainly valid document; anything it does not accept is judged,
and its reason worded, by the full JSON Schema, so both accept exactly the same.)

An agent that has several alerts at once (the ranks of its machine timing out
together) publishes them as one **batch document**, ``{"schema": 1, "alerts":
[<alert>, ...]}`` (:func:`batch_document`): one machine's alerts, at most
:data:`MAX_BATCH_ALERTS` of them and :data:`MAX_ALERT_BYTES` in all, so a storm
from every rank of a fleet is one object per machine on the bus. A lone alert is
still published as a single-alert document, and readers take both
(:func:`parse_document`); a batch is accepted whole or refused whole (the reason
names the first alert at fault). A reader older than batch documents quarantines
them: upgrade the control plane before the agents.

The bus is an untrusted input (a machine with a broken clock, a buggy or forged
writer), so every field is bounded: a whole document above :data:`MAX_ALERT_BYTES`
is refused unread, every string of the schema has a length limit, and evidence
above :data:`MAX_EVIDENCE_BYTES` is cut down (:func:`bound_evidence`: long strings
and lists shortened, deep structures dropped) and marked ``"_truncated"`` with its
original size, by the writer before it publishes and by the reader again. A reader
also notes when it first read an alert (``received_ts``, its own clock) and, when
the writer's ``ts`` is far from that, the offset (``clock_skew_s``); neither is part
of the published document.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from trainguard.core.errors import TrainguardError
from trainguard.node_tools import __version__

SCHEMA_VERSION = 1
SEVERITIES = ("info", "warning", "fault")
#: a document above this (a single alert or a batch) is refused without being parsed (quarantined with the reason)
MAX_ALERT_BYTES = 64 * 1024
#: the most alerts one batch document holds
MAX_BATCH_ALERTS = 256
#: evidence above this (as compact JSON) is cut down and marked ``_truncated``
MAX_EVIDENCE_BYTES = 8 * 1024
#: how evidence is cut down: strings to this many characters, lists to their last items, depth
EVIDENCE_STRING_CHARS = 512
EVIDENCE_LIST_ITEMS = 20
EVIDENCE_DEPTH = 3

#: kind -> what it means. The control plane's triage keys on these names.
ALERT_KINDS: dict[str, str] = {
    # ranks (from the in-job hook's files and the process table)
    "rank_exit": "a training rank's process ended while its job was running",
    "rank_stopped": "a rank's heartbeat stopped although its process exists (stopped or frozen)",
    "rank_hang": "a live rank made no progress (step or collective) for longer than its calibrated timeout",
    "nan_loss": "a rank reported a NaN or infinite loss or gradient norm",
    "loss_spike": "a rank's loss jumped to more than 5x its recent median and twice its recent largest",
    "grad_spike": "a rank's gradient norm jumped to more than 5x its recent median and twice its recent largest",
    "rank_slow": "a rank's steps take several times their recent median (throughput decline)",
    "sdc_suspect": "a rank's parameters differ from its data-parallel peers' (silent data corruption)",
    # GPU (NVML)
    "gpu_lost": "fewer GPUs are visible than the machine should have",
    "gpu_xid": "the driver reported an Xid error",
    "gpu_ecc": "an uncorrectable ECC error, or a row remap pending",
    "gpu_thermal": "a GPU is too hot or thermally throttled",
    "gpu_pcie": "a GPU's PCIe link runs below its maximum generation or width",
    # network
    "nic_down": "the job's network link has no carrier or is administratively down",
    "nic_errors": "the link's error counters grew",
    # disk
    "disk_full": "the machine's work directory is (nearly) out of space",
    "disk_readonly": "the machine's work directory is read-only",
    # kernel log
    "kernel_xid": "the kernel log has an NVIDIA Xid line",
    "kernel_mce": "the kernel log reports a machine check",
    "kernel_oom": "the kernel's OOM killer killed a process",
    "kernel_fs": "the kernel log reports a file-system error",
    "kernel_link": "the kernel log reports a network link going down",
    # notices (severity info, on the bus's notices folder: they start scheduled work, never an incident)
    "checkpoint_committed": "a job committed a checkpoint step on every rank (the verification DAG's cue)",
    # throughput (the agent, from the ranks' step records)
    "throughput_decline": "a job's tokens/s stayed well below its own trailing median for several steps",
    # the control plane's own findings about trainguard's parts
    "agent_silent": "a machine's agent published no heartbeat for longer than its threshold (stopped, hung or gone)",
    "job_down": "the reconciler found the job's process not running on a machine while the fleet database says the "
                "job runs and no incident handles it",
    "job_stalled": "the reconciler found every machine running the job but its lowest step unchanged for longer than "
                   "TG_RECONCILE_STALL_S, no rank holding still, and no incident handling it",
    "job_held": "the reconciler found a rank holding still on purpose (the NaN guard waiting for a restart from the "
                "last finite step) on two looks TG_RECONCILE_CONFIRM_S apart, and no incident handling it",
}

#: Kinds published to the bus's notices folder instead of its alerts.
NOTICE_KINDS = frozenset({"checkpoint_committed"})

ALERT_JSON_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "additionalProperties": False,
    "required": ["schema", "id", "job", "machine", "rank", "kind", "severity", "ts", "evidence", "agent_version"],
    "properties": {
        "schema": {"const": SCHEMA_VERSION},
        "id": {"type": "string", "pattern": "^[0-9a-f]{8,64}$"},
        "job": {"type": "string", "maxLength": 64},
        "machine": {"type": "string", "minLength": 1, "maxLength": 63, "pattern": "^[A-Za-z0-9][A-Za-z0-9._-]*$"},
        "rank": {"type": ["integer", "null"], "minimum": 0, "maximum": 1 << 24},
        "kind": {"enum": sorted(ALERT_KINDS)},
        "severity": {"enum": list(SEVERITIES)},
        "ts": {"type": "number", "minimum": 0, "maximum": 1e11},
        "evidence": {"type": "object", "maxProperties": 64},
        "agent_version": {"type": "string", "maxLength": 32, "pattern": r"^\d+\.\d+\.\d+"},
    },
}


class AlertError(TrainguardError):
    """A document that is not a valid alert (the reader moves it aside with this reason)."""


WIRE_FIELDS = ("schema", "id", "job", "machine", "rank", "kind", "severity", "ts", "evidence", "agent_version")


@dataclass
class Alert:
    """One alert. ``received_ts`` and ``clock_skew_s`` are a reader's notes (see the module's text), never
    published."""

    kind: str
    machine: str
    severity: str = "fault"
    job: str = ""
    rank: int | None = None
    evidence: dict[str, Any] = field(default_factory=dict)
    ts: float = field(default_factory=time.time)
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    agent_version: str = __version__
    schema: int = SCHEMA_VERSION
    received_ts: float | None = field(default=None, compare=False)
    clock_skew_s: float | None = field(default=None, compare=False)
    bus_name: str | None = field(default=None, compare=False)  # its object name on the bus, when read from one

    def to_dict(self) -> dict[str, Any]:
        """The published document (the reader's notes left out): a copy, sharing nothing mutable with the alert."""
        evidence = _plain_copy(self.evidence)
        if evidence is _NOT_PLAIN:  # something other than JSON's types inside: the general deep copy
            return {k: v for k, v in asdict(self).items() if k in WIRE_FIELDS}
        return {"kind": self.kind, "machine": self.machine, "severity": self.severity, "job": self.job,
                "rank": self.rank, "evidence": evidence, "ts": self.ts, "id": self.id,
                "agent_version": self.agent_version, "schema": self.schema}

    def record(self) -> dict[str, Any]:
        """The document with the reader's notes, as the control plane keeps it: ``received_ts``, ``bus_name``
        and, when the writer's clock is off, ``clock_skew_s``."""
        out = self.to_dict()
        if self.received_ts is not None:
            out["received_ts"] = self.received_ts
        if self.clock_skew_s is not None:
            out["clock_skew_s"] = self.clock_skew_s
        if self.bus_name is not None:
            out["bus_name"] = self.bus_name
        return out

    def to_json(self) -> str:
        document = self.to_dict()
        document["evidence"], _ = bound_evidence(document["evidence"])
        validate(document)
        return json.dumps(document, separators=(",", ":"), default=str)

    @classmethod
    def from_json(cls, text: str | bytes, *, max_bytes: int = MAX_ALERT_BYTES) -> Alert:
        """Parse and validate one published alert; evidence over the limit is cut down and marked. A
        document over ``max_bytes`` is refused unread."""
        return cls.from_document(_load(text, max_bytes))

    @classmethod
    def from_document(cls, document: Any) -> Alert:
        """Validate one parsed alert document; evidence over the limit is cut down and marked."""
        validate(document)
        document["evidence"], _ = bound_evidence(document["evidence"])
        return cls(**document)


def _load(text: str | bytes, max_bytes: int) -> Any:
    if len(text) > max_bytes:
        raise AlertError(f"{len(text)} bytes, over the limit of {max_bytes} bytes for one alert")
    try:
        return json.loads(text)
    except ValueError as exc:
        raise AlertError(f"not JSON: {str(exc)[:200]}") from None


def batch_document(alerts: Sequence[Alert], *, max_bytes: int = MAX_ALERT_BYTES,
                   max_alerts: int = MAX_BATCH_ALERTS) -> tuple[int, str]:
    """One document holding the first alerts of ``alerts``, as many as fit: all of one machine (the first's),
    at most ``max_alerts`` and ``max_bytes`` in all. Returns how many it holds and its JSON; one alert is its
    own single-alert document (what :meth:`Alert.to_json` gives). Each alert is validated as it is added."""
    if not alerts:
        raise ValueError("a batch document needs at least one alert")
    head, tail = f'{{"schema":{SCHEMA_VERSION},"alerts":[', "]}"
    docs: list[str] = []
    size = len(head) + len(tail)
    for alert in alerts[:max_alerts]:
        if alert.machine != alerts[0].machine:
            break
        text = alert.to_json()  # ASCII: characters are bytes
        if docs and size + len(text) + 1 > max_bytes:
            break
        docs.append(text)
        size += len(text) + 1
    if len(docs) == 1:
        return 1, docs[0]
    return len(docs), head + ",".join(docs) + tail


def parse_document(text: str | bytes, *, max_bytes: int = MAX_ALERT_BYTES) -> list[Alert]:
    """The alerts of one document of the bus, a single alert or a batch (see the module's text), validated. A
    document over ``max_bytes`` is refused unread; a batch with any alert that is not valid is refused whole,
    the reason naming it (``alerts/3/kind: ...``)."""
    document = _load(text, max_bytes)
    if not (isinstance(document, dict) and "alerts" in document and "kind" not in document):
        return [Alert.from_document(document)]
    if document.get("schema") != SCHEMA_VERSION:
        raise AlertError(f"batch schema {document.get('schema')!r} is unknown; this reader reads {SCHEMA_VERSION}")
    extra = sorted(set(document) - {"schema", "alerts"})
    if extra:
        raise AlertError(f"batch: additional properties are not allowed ({', '.join(map(str, extra))[:200]})")
    items = document["alerts"]
    if not isinstance(items, list) or not 1 <= len(items) <= MAX_BATCH_ALERTS:
        size = len(items) if isinstance(items, list) else type(items).__name__
        raise AlertError(f"alerts: a batch holds 1 to {MAX_BATCH_ALERTS} alerts, not {size}")
    out = []
    for i, item in enumerate(items):
        try:
            out.append(Alert.from_document(item))
        except AlertError as exc:
            raise AlertError(f"alerts/{i}/{exc}") from None
    return out


_NOT_PLAIN = object()
_ATOMS = (str, int, float, bool, type(None))


def _plain_copy(value: Any) -> Any:
    """A deep copy of ``value`` made only of JSON's types (dict, list, tuple, str, numbers, None), or
    ``_NOT_PLAIN`` when anything else is inside."""
    kind = type(value)
    if kind in _ATOMS:
        return value
    if kind is dict:
        out = {}
        for k, v in value.items():
            if type(k) not in _ATOMS:
                return _NOT_PLAIN
            c = _plain_copy(v)
            if c is _NOT_PLAIN:
                return _NOT_PLAIN
            out[k] = c
        return out
    if kind is list or kind is tuple:
        items = [_plain_copy(v) for v in value]
        if any(c is _NOT_PLAIN for c in items):
            return _NOT_PLAIN
        return items if kind is list else tuple(items)
    return _NOT_PLAIN


def _compact(value: Any) -> int:
    return len(json.dumps(value, separators=(",", ":"), default=str))


def _shrink(value: Any, depth: int) -> Any:
    if isinstance(value, str):
        return value if len(value) <= EVIDENCE_STRING_CHARS else value[:EVIDENCE_STRING_CHARS] + "..."
    if isinstance(value, (bool, int, float)) or value is None:
        return value
    if depth >= EVIDENCE_DEPTH:
        return f"<{type(value).__name__} dropped>"
    if isinstance(value, dict):
        return {str(k)[:64]: _shrink(v, depth + 1) for k, v in list(value.items())[:64]}
    if isinstance(value, (list, tuple)):
        return [_shrink(v, depth + 1) for v in list(value)[-EVIDENCE_LIST_ITEMS:]]
    return str(value)[:EVIDENCE_STRING_CHARS]


def bound_evidence(evidence: Any, limit: int = MAX_EVIDENCE_BYTES) -> tuple[dict[str, Any], bool]:
    """``evidence`` within ``limit`` bytes of compact JSON, and whether it had to be cut: long strings and
    lists shortened and deep structures dropped first; then, if still too big, the largest fields dropped
    one by one. A cut one carries ``"_truncated": {"bytes": <original size>, "limit": limit}``."""
    if not isinstance(evidence, dict):
        evidence = {"value": evidence}
    size = _compact(evidence)
    if size <= limit:
        return evidence, False
    out = _shrink(evidence, 0)
    out["_truncated"] = {"bytes": size, "limit": limit}
    while _compact(out) > limit:
        sizes = {k: _compact(v) for k, v in out.items() if k != "_truncated"}
        if not sizes:
            break
        del out[max(sizes, key=lambda k: sizes[k])]
    return out, True


_validator: Any = None
_FIELDS = frozenset(WIRE_FIELDS)
_KINDS = frozenset(ALERT_KINDS)
_ID = re.compile(r"[0-9a-f]{8,64}")
_MACHINE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_VERSION = re.compile(r"\d+\.\d+\.\d+")


def _plainly_valid(d: Any) -> bool:
    """True only for documents :data:`ALERT_JSON_SCHEMA` accepts, checked field by field in plain Python (about
    40 times faster than the JSON Schema); False for anything unusual, which the JSON Schema then judges."""
    if type(d) is not dict or d.keys() != _FIELDS:
        return False
    rank, ts, evidence, version, ident, machine = (d["rank"], d["ts"], d["evidence"], d["agent_version"], d["id"],
                                                  d["machine"])
    return bool(
        type(d["schema"]) is int and d["schema"] == SCHEMA_VERSION
        and type(ident) is str and _ID.fullmatch(ident)
        and type(d["job"]) is str and len(d["job"]) <= 64
        and type(machine) is str and len(machine) <= 63 and _MACHINE.fullmatch(machine)
        and (rank is None or (type(rank) is int and 0 <= rank <= 1 << 24))
        and type(d["kind"]) is str and d["kind"] in _KINDS
        and type(d["severity"]) is str and d["severity"] in SEVERITIES
        and type(ts) in (int, float) and 0 <= ts <= 1e11
        and type(evidence) is dict and len(evidence) <= 64
        and type(version) is str and len(version) <= 32 and _VERSION.match(version))


def validate(document: Any) -> None:
    """Raise :class:`AlertError` with a one-line reason unless ``document`` is a valid alert."""
    global _validator
    if not _plainly_valid(document):
        if _validator is None:
            import jsonschema

            _validator = jsonschema.Draft202012Validator(ALERT_JSON_SCHEMA)
        if isinstance(document, dict) and document.get("schema") not in (None, SCHEMA_VERSION):
            raise AlertError(f"alert schema {document.get('schema')!r} is unknown; this reader reads "
                             f"{SCHEMA_VERSION}")
        errors = sorted(_validator.iter_errors(document), key=lambda e: list(e.path))
        if errors:
            err = errors[0]
            where = "/".join(str(p) for p in err.path) or "alert"
            raise AlertError(f"{where}: {err.message}")
    major = str(document["agent_version"]).split(".")[0]
    if major != __version__.split(".")[0]:
        raise AlertError(
            f"agent version {document['agent_version']} is not compatible with {__version__} (major version differs)"
        )
