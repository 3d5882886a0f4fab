"""Stop-time diagnosis that is robust to load, as plain functions.

A diagnosis runs while other machines are diagnosed beside it, on hosts that may be busy: an absolute
floor alone (a memory bandwidth of 0.5 GB/s) fails healthy machines that merely share their cores. So:

* a *measurement* (a bandwidth) is judged against the peers measured in the same round: a machine fails it
  only when it is also far below the median of its peers (less than ``PEER_SHARE`` of it); when every
  machine is slow, the load is shared and nobody fails on it;
* a *correctness* failure (a wrong matmul result, a copy that came back different, a collective that
  delivered wrong data, a GPU missing) fails on its own;
* a failed reading is repeated before it can evict (the controller runs the level again, alone).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from typing import Any

#: a measurement below this share of the median of the peers measured in the same round fails
PEER_SHARE = 0.5
#: tests whose failure can be a measurement below a floor (the rest are correctness)
MEASURED = {"memory": "gbps"}


def _measured_only(doc: Mapping[str, Any]) -> dict[str, float] | None:
    """The measurements of a report whose failed tests all failed a floor only: test -> value; None when a
    correctness test failed (or a failed test has no measurement)."""
    out: dict[str, float] = {}
    for t in doc.get("tests") or []:
        if t.get("ok") or t.get("name") == "collective_neighbours":
            continue
        key = MEASURED.get(str(t.get("name")))
        value = ((t.get("details") or {}).get(key)) if key else None
        if not isinstance(value, (int, float)) or "below the floor" not in str(t.get("reason", "")) or \
                "came back different" in str(t.get("reason", "")):
            return None
        out[str(t["name"])] = float(value)
    return out


def _value(doc: Mapping[str, Any], test: str) -> float | None:
    for t in doc.get("tests") or []:
        if t.get("name") == test:
            value = (t.get("details") or {}).get(MEASURED[test])
            return float(value) if isinstance(value, (int, float)) else None
    return None


def forgiven_by_peers(round_docs: Mapping[str, Mapping[str, Any] | None]) -> dict[str, str]:
    """Machines of one round (machine -> its L2 report) whose only failures are measurements below a floor
    while they are not far below their peers' median: machine -> why it passes. With no peer measured, the
    floor stands."""
    out: dict[str, str] = {}
    for machine, doc in round_docs.items():
        measured = _measured_only(doc) if doc else None
        if not measured:
            continue
        whys = []
        for test, value in measured.items():
            peers = [v for m, d in round_docs.items() if m != machine and d
                     for v in [_value(d, test)] if v is not None]
            if not peers:
                break
            median = statistics.median(peers)
            if value < PEER_SHARE * median:
                break
            whys.append(f"{test} {value:.3g} is {value / median:.0%} of its {len(peers)} peers' median "
                        f"{median:.3g}, measured in the same round: the load is shared")
        else:
            out[machine] = "; ".join(whys)
    return out
