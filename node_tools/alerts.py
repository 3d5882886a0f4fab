"""The alert: what a machine's agent tells the control plane, as versioned JSON.

One alert is one JSON object::

    {"schema": 1, "id": "3f2c...", "job": "demo", "machine": "m2", "rank": 5,
     "kind": "rank_exit", "severity": "fault", "ts": 1795250046.7,
     "evidence": {"pid": 20059, "returncode": -9, "log_tail": ["..."]},
     "agent_version": "0.1.0"}

``rank`` is null for machine-level alerts, ``job`` is "" when no job is
concerned. It is validated with a JSON Schema on both ends: by the agent before
it publishes and by every reader before it acts. Readers refuse alerts of an
unknown schema version or from an agent of another major version.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any

from node_tools import __version__
from node_tools.errors import TrainguardError

SCHEMA_VERSION = 1
SEVERITIES = ("info", "warning", "fault")

#: kind -> what it means. The control plane's triage keys on these names.
ALERT_KINDS: dict[str, str] = {
    # ranks (from the in-job hook's files and the process table)
    "rank_exit": "a training rank's process ended while its job was running",
    "rank_stopped": "a rank's heartbeat stopped although its process exists (stopped or frozen)",
    "rank_hang": "a live rank made no progress (step or collective) for longer than its calibrated timeout",
    "nan_loss": "a rank reported a NaN or infinite loss or gradient norm",
    "loss_spike": "a rank's loss jumped to more than 5x its recent median",
    "grad_spike": "a rank's gradient norm jumped to more than 5x its recent median",
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
        "machine": {"type": "string", "minLength": 1, "maxLength": 63},
        "rank": {"type": ["integer", "null"], "minimum": 0},
        "kind": {"enum": sorted(ALERT_KINDS)},
        "severity": {"enum": list(SEVERITIES)},
        "ts": {"type": "number", "minimum": 0},
        "evidence": {"type": "object"},
        "agent_version": {"type": "string", "pattern": r"^\d+\.\d+\.\d+"},
    },
}


class AlertError(TrainguardError):
    """A document that is not a valid alert (the reader moves it aside with this reason)."""


@dataclass
class Alert:
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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        document = self.to_dict()
        validate(document)
        return json.dumps(document, separators=(",", ":"), default=str)

    @classmethod
    def from_json(cls, text: str | bytes) -> Alert:
        try:
            document = json.loads(text)
        except ValueError as exc:
            raise AlertError(f"not JSON: {exc}") from None
        validate(document)
        return cls(**document)


_validator: Any = None


def validate(document: Any) -> None:
    """Raise :class:`AlertError` with a one-line reason unless ``document`` is a valid alert."""
    global _validator
    if _validator is None:
        import jsonschema

        _validator = jsonschema.Draft202012Validator(ALERT_JSON_SCHEMA)
    if isinstance(document, dict) and document.get("schema") not in (None, SCHEMA_VERSION):
        raise AlertError(f"alert schema {document.get('schema')!r} is unknown; this reader reads {SCHEMA_VERSION}")
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
