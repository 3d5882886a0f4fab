"""Why a job's ranks ended, from their logs on this machine.

``logs(cfg, job)`` reads the newest incarnation of the job: torchrun's exit code
(``exit.json``), torchrun's failure report (``supervisor.log``: each failed
local rank's exit code), and for every local rank the tail of its stderr
(``<log_dir>/*/attempt_*/<local_rank>/stderr.log``), its last heartbeat and a
classification of how it failed:

``infrastructure``
    CUDA / NCCL / gloo / collective and timeout errors, running out of memory,
    I/O errors (``OSError: [Errno N]``, a full or read-only disk), connections
    reset or refused, a rank killed with SIGKILL.
``user_code``
    A Python exception whose traceback's last frame is in the job's own files
    (under the directory of its training script; not site-packages, the
    standard library or torch), e.g. the reference job's ``IndexError`` in
    ``shuffle_window``.
``none``
    Nothing went wrong (yet): a clean exit, or a rank that still runs.
``unknown``
    It failed, and the log does not say why in a way the rules know.

The rules are :func:`classify`, a pure function of the log lines. The job's
verdict names the rank that failed first: ranks whose error only echoes another
rank's end (a connection closed or reset by the peer) are not candidates when
some other rank failed for a reason of its own; among the candidates the
earliest failure wins (a rank's stderr modification time when the evidence is
in its log, its last heartbeat when it was killed without a word). torchrun's
own "Root Cause (first observed failure)" is reported but not trusted: without
error files it names whichever failed rank it looked at first.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sysconfig
import time
from pathlib import Path
from typing import Any

from trainguard.core.errors import EXIT_OK, UNRESTORABLE, TrainguardError
from trainguard.node_tools import job as jobmod
from trainguard.node_tools import monitor
from trainguard.node_tools.config import NodeConfig

#: how much of the end of a stderr file is read for classification (a traceback can be long)
CLASSIFY_BYTES = 512 * 1024
CLASSIFY_LINES = 4000

_PREFIX_RE = re.compile(r"^\[(?:rank|default)?\d+\]:[ ]?")
_FRAME_RE = re.compile(r'^\s+File "(?P<file>.+)", line (?P<line>\d+)(?:, in (?P<func>.+))?$')
_EXC_RE = re.compile(r"^(?P<type>[A-Za-z_][\w.]*)(?::[ ]?(?P<message>.*))?$")
# a line that is another log record, not the continuation of an exception's message
_LOG_RECORD_RE = re.compile(r"^(?:\[[^\]]*\]|[IWEF]\d{4} |\d{4}-\d\d-\d\d)|warning", re.IGNORECASE)
_CHAIN_MARKERS = (
    "During handling of the above exception, another exception occurred:",
    "The above exception was the direct cause of the following exception:",
)

# Exception types that are programming errors: in the job's own code they are the job's bug, whatever
# words their message happens to contain ("invalid timeout value").
PROGRAMMING_ERRORS = frozenset({
    "IndexError", "KeyError", "ValueError", "TypeError", "AttributeError", "NameError", "UnboundLocalError",
    "AssertionError", "ZeroDivisionError", "NotImplementedError", "ImportError", "ModuleNotFoundError",
    "SyntaxError", "IndentationError", "RecursionError", "LookupError", "ArithmeticError", "StopIteration",
    "FileNotFoundError", "IsADirectoryError", "NotADirectoryError", "FileExistsError", "PermissionError",
})

# A rank that ended because no checkpoint step could be restored on every rank (class unknown: no machine's fault,
# not the code's): the control plane rescues the missing copies before it restarts again.
UNRESTORABLE_KIND = "checkpoint_unrestorable"

# (kind, pattern). Checked in this order; the first match names the kind.
INFRA_PATTERNS: tuple[tuple[str, re.Pattern[str]], ...] = tuple((kind, re.compile(rx, re.IGNORECASE)) for kind, rx in (
    ("oom", r"out of memory|OutOfMemoryError|\bMemoryError\b|Cannot allocate memory|std::bad_alloc|^Killed$"),
    ("io", r"No space left on device|Read-only file system|Input/output error|Disk quota exceeded|"
           r"Stale file handle|^(?:builtins\.)?(?:OSError|IOError)\b.*\[Errno \d+\]|\bE(?:NOSPC|IO|ROFS|DQUOT)\b"),
    ("peer_connection", r"Connection (?:reset|closed) by peer|ConnectionResetError|BrokenPipeError|Broken pipe|"
                        r"remote worker crash"),
    ("network", r"Connection refused|ConnectionRefusedError|ConnectionAbortedError|No route to host|"
                r"Network is unreachable|Connection timed out|DistNetworkError|"
                r"Temporary failure in name resolution|Name or service not known"),
    ("collective_timeout", r"Watchdog caught collective operation timeout|collective operation timeout|"
                           r"\btimed? ?out\b|TimeoutError|DistStoreError|\bTimeout\(ms\)"),
    ("cuda", r"\bCUDA error\b|\bcudaError\w*|CUBLAS_STATUS_\w+|CUDNN_STATUS_\w+|CUDA driver|"
             r"no CUDA-capable device|uncorrectable ECC|\bECC error|\bXid\b|GPU is lost|fallen off the bus|"
             r"illegal memory access"),
    ("nccl", r"\bNCCL\b|\bnccl\w*Error\b|ProcessGroupNCCL|DistBackendError"),
    ("gloo", r"\bgloo\b|ProcessGroupGloo"),
    ("signal", r"\bSIGKILL\b|\bSignal 9\b|exitcode\s*:\s*-9\b|\bSIGBUS\b|^Bus error|Fatal Python error: Bus error"),
))
# Without a traceback, only lines that read as errors are matched (a warning that mentions NCCL is not a failure).
_ERRORISH_RE = re.compile(r"error|exception|fatal|what\(\):|terminate called|^\[E|^E\d{4} |^Killed$|abort|"
                          r"SIG[A-Z]+|Segmentation fault|core dumped", re.IGNORECASE)
_WARNING_RE = re.compile(r"warning|\bWARN\b|^\[W|^W\d{4} ", re.IGNORECASE)
_FATAL_UNKNOWN_RE = re.compile(r"Segmentation fault|Fatal Python error|core dumped|terminate called|Aborted",
                               re.IGNORECASE)

SIGNAL_NAMES = {1: "SIGHUP", 2: "SIGINT", 4: "SIGILL", 6: "SIGABRT", 7: "SIGBUS", 8: "SIGFPE", 9: "SIGKILL",
                11: "SIGSEGV", 13: "SIGPIPE", 15: "SIGTERM"}


def strip_prefix(line: str) -> str:
    """A log line without torchrun's ``[rankN]:`` (or ``[defaultN]:``) prefix and its line end."""
    return _PREFIX_RE.sub("", line.rstrip("\r\n"), count=1)


# ---------------------------------------------------------------------------------------
# Tracebacks
# ---------------------------------------------------------------------------------------
def parse_tracebacks(lines: list[str]) -> list[list[dict[str, Any]]]:
    """The Python tracebacks in ``lines`` (prefixes already stripped), grouped into chains.

    A chain is the list of exceptions joined by "During handling of the above
    exception..." or "The above exception was the direct cause...", the one that
    propagated last. Each exception: ``{"type", "message", "frames": [{"file",
    "line", "function"}], "exc_line", "index"}`` with frames outermost first, as
    Python prints them.
    """
    chains: list[list[dict[str, Any]]] = []
    chained_next = False
    i, n = 0, len(lines)
    while i < n:
        text = lines[i]
        if text.strip() in _CHAIN_MARKERS:
            chained_next = True
            i += 1
            continue
        if text.rstrip() != "Traceback (most recent call last):":
            if text.strip():
                chained_next = False  # something else came between a traceback and the next
            i += 1
            continue
        frames: list[dict[str, Any]] = []
        i += 1
        while i < n:
            if not lines[i].startswith((" ", "\t")):
                # another thread's line written into the middle of the traceback: frames go on after it
                nxt = lines[i + 1:i + 3]
                if nxt and (_FRAME_RE.match(nxt[0]) or (len(nxt) == 2 and nxt[0].startswith((" ", "\t"))
                                                        and _FRAME_RE.match(nxt[1]))):
                    i += 1
                    continue
                break
            m = _FRAME_RE.match(lines[i])
            if m:
                frames.append({"file": m["file"], "line": int(m["line"]), "function": m["func"] or ""})
            i += 1
        exc: dict[str, Any] = {"type": None, "message": "", "frames": frames, "exc_line": "", "index": i}
        if i < n:
            m = _EXC_RE.match(lines[i].strip())
            exc["exc_line"] = lines[i].strip()
            if m:
                exc["type"] = m["type"]
                message = [m["message"] or ""]
                j = i + 1
                # multi-line messages (NCCL's) run until a blank line or the next traceback
                while (j < n and j - i <= 20 and lines[j].strip() and lines[j].strip() not in _CHAIN_MARKERS
                       and lines[j].rstrip() != "Traceback (most recent call last):"
                       and not _LOG_RECORD_RE.search(lines[j].strip())):
                    message.append(lines[j].strip())
                    j += 1
                exc["message"] = "\n".join(part for part in message if part)
                i = j
            else:
                i += 1
        if chained_next and chains:
            chains[-1].append(exc)
        else:
            chains.append([exc])
        chained_next = False
    return chains


def _stdlib_dirs() -> list[str]:
    paths = sysconfig.get_paths()
    return sorted({os.path.normpath(paths[k]) + os.sep for k in ("stdlib", "platstdlib") if paths.get(k)})


_LIBRARY_RE = re.compile(r"[/\\](?:site-packages|dist-packages)[/\\]|[/\\]lib[/\\]python3(?:\.\d+)?[/\\]|"
                         r"(?:^|[/\\])torch[/\\]")


def is_job_file(path: str, job_roots: list[str]) -> bool:
    """True if ``path`` (as a traceback prints it) is the job's own code.

    Not: ``<frozen ...>``/``<string>`` pseudo-files, anything in site-packages or
    dist-packages, the standard library, or torch. With ``job_roots``, an
    absolute path must also lie under one of them; relative paths (a script run
    from its own directory) count as the job's.
    """
    if not path or path.startswith("<"):
        return False
    if _LIBRARY_RE.search(path):
        return False
    norm = os.path.normpath(path)
    if any(norm.startswith(d) for d in _stdlib_dirs()):
        return False
    if not os.path.isabs(norm) or not job_roots:
        return True
    for root in job_roots:
        r = os.path.normpath(str(root))
        if norm == r or norm.startswith(r.rstrip(os.sep) + os.sep):
            return True
    return False


def _infra_match(text: str) -> tuple[str, str] | None:
    for line in text.splitlines() or [text]:
        for kind, rx in INFRA_PATTERNS:
            if rx.search(line):
                return kind, line.strip()
    return None


def _exception_doc(exc: dict[str, Any]) -> dict[str, Any]:
    last = exc["frames"][-1] if exc["frames"] else None
    return {
        "type": exc["type"],
        "message": exc["message"],
        "file": last["file"] if last else None,
        "line": last["line"] if last else None,
        "function": last["function"] if last else None,
        "location": f"{last['file']}:{last['line']}" if last else None,
    }


def classify(lines: list[str], job_roots: list[str], *, exitcode: int | None = None) -> dict[str, Any]:
    """Classify a rank's end from its stderr lines (torchrun's ``[rankN]:`` prefixes are stripped).

    Returns ``{"class": "infrastructure"|"user_code"|"none"|"unknown", "kind": the
    infrastructure kind (oom, io, peer_connection, network, collective_timeout,
    cuda, nccl, gloo, signal), ``checkpoint_unrestorable`` (class unknown) or None,
    "evidence": the matched line or None,
    "exception": {"type", "message", "file", "line", "function", "location"} of
    the exception that ended the rank (None without a traceback), "user_frame":
    "file:line" of the innermost frame in the job's own files (None if none)}``.

    Rules, in order: the last traceback chain (the exception that propagated,
    with the ones it was raised while handling): a programming error (IndexError,
    KeyError, ...) whose last frame is the job's own code is ``user_code``; an
    infrastructure pattern in any of the chain's exception lines is
    ``infrastructure``; a last frame in the job's own code is ``user_code``;
    else ``unknown``. Without a traceback, error lines (not warnings) are matched
    against the infrastructure patterns; a segfault or abort is ``unknown``. Last,
    ``exitcode`` (torchrun's, negative for a signal): -9 (SIGKILL) or -7 (SIGBUS)
    is ``infrastructure``, another non-zero code ``unknown``.
    """
    text = [strip_prefix(line) for line in lines]
    result: dict[str, Any] = {"class": "none", "kind": None, "evidence": None, "exception": None, "user_frame": None}
    # the checkpoint library refused to start from scratch (whatever lines about damaged copies came before)
    unrestorable = next((line.strip() for line in text if UNRESTORABLE in line), None)
    if unrestorable:
        return result | {"class": "unknown", "kind": UNRESTORABLE_KIND, "evidence": unrestorable}
    chains = parse_tracebacks(text)
    if chains:
        chain = chains[-1]
        final = chain[-1]
        frames = final["frames"]
        ours = [f for f in frames if is_job_file(f["file"], job_roots)]
        result["exception"] = _exception_doc(final)
        result["user_frame"] = f"{ours[-1]['file']}:{ours[-1]['line']}" if ours else None
        last_is_ours = bool(frames) and is_job_file(frames[-1]["file"], job_roots)
        if last_is_ours and (final["type"] or "").rsplit(".", 1)[-1] in PROGRAMMING_ERRORS:
            return result | {"class": "user_code", "evidence": final["exc_line"]}
        for exc in reversed(chain):
            found = _infra_match(f"{exc['exc_line']}\n{exc['message']}")
            if found:
                return result | {"class": "infrastructure", "kind": found[0], "evidence": found[1]}
        if last_is_ours:
            return result | {"class": "user_code", "evidence": final["exc_line"]}
        return result | {"class": "unknown", "evidence": final["exc_line"] or "a traceback without its exception"}
    fatal = None
    for line in text:
        stripped = line.strip()
        if not stripped or _WARNING_RE.search(stripped) or not _ERRORISH_RE.search(stripped):
            continue
        found = _infra_match(stripped)
        if found:
            return result | {"class": "infrastructure", "kind": found[0], "evidence": found[1]}
        if fatal is None and _FATAL_UNKNOWN_RE.search(stripped):
            fatal = stripped
    if fatal:
        return result | {"class": "unknown", "evidence": fatal}
    if exitcode is not None and exitcode != 0:
        if exitcode < 0:
            name = SIGNAL_NAMES.get(-exitcode, f"signal {-exitcode}")
            if -exitcode in (7, 9):
                return result | {"class": "infrastructure", "kind": "signal",
                                 "evidence": f"exit code {exitcode}: killed by {name}"}
            return result | {"class": "unknown", "evidence": f"exit code {exitcode}: killed by {name}"}
        return result | {"class": "unknown", "evidence": f"exit code {exitcode}"}
    return result


# ---------------------------------------------------------------------------------------
# torchrun's failure report
# ---------------------------------------------------------------------------------------
_REPORT_ENTRY_RE = re.compile(
    r"^\[\d+\]:\s*\n\s+time\s*:\s*(?P<time>\S+)\s*\n\s+host\s*:\s*(?P<host>.*?)\s*\n"
    r"\s+rank\s*:\s*(?P<rank>-?\d+) \(local_rank: (?P<local_rank>\d+)\)\s*\n"
    r"\s+exitcode\s*:\s*(?P<exitcode>-?\d+) \(pid: (?P<pid>\d+)\)\s*\n"
    r"(?:\s+error_file\s*:\s*(?P<error_file>.*?)\s*\n)?(?:\s+traceback\s*:\s*(?P<traceback>.*?)\s*$)?",
    re.MULTILINE,
)


def parse_torchrun_report(text: str, *, not_before: float = 0.0) -> dict[str, Any] | None:
    """The last ChildFailedError report in torchrun's output: ``{"failures": [...], "root_cause": {...}}``.

    Entries: rank, local_rank, exitcode, pid, time (epoch, local time, 1 s
    resolution), traceback. Reports older than ``not_before`` (an earlier
    incarnation's, in an appended log) are ignored.
    """
    start = text.rfind("ChildFailedError")
    if start < 0:
        return None
    block = text[start:]
    root_at = block.find("Root Cause")
    entries = []
    for m in _REPORT_ENTRY_RE.finditer(block):
        try:
            ts = time.mktime(time.strptime(m["time"], "%Y-%m-%d_%H:%M:%S"))
        except ValueError:
            ts = None
        entries.append({
            "rank": int(m["rank"]), "local_rank": int(m["local_rank"]), "exitcode": int(m["exitcode"]),
            "pid": int(m["pid"]), "time": ts, "traceback": m["traceback"],
            "root_cause": root_at >= 0 and m.start() > root_at,
        })
    if not entries or all(e["time"] is not None and e["time"] < not_before - 2 for e in entries):
        return None
    return {
        "failures": [e for e in entries if not e["root_cause"]],
        "root_cause": next((e for e in entries if e["root_cause"]), None),
    }


# ---------------------------------------------------------------------------------------
# The command
# ---------------------------------------------------------------------------------------
def _read_tail(path: Path, max_bytes: int = CLASSIFY_BYTES) -> list[str]:
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - max_bytes))
            data = fh.read()
    except OSError:
        return []
    lines = data.decode("utf-8", errors="replace").splitlines()
    if size > max_bytes and lines:
        lines = lines[1:]  # the first line is probably cut
    return lines[-CLASSIFY_LINES:]


def _mtime(path: Path | None) -> float | None:
    try:
        return path.stat().st_mtime if path else None
    except OSError:
        return None


def job_roots_of(cfg: NodeConfig, record: dict[str, Any]) -> list[str]:
    """The job's own code: the directory of its training script (as given and resolved), or the working directory
    a module was run from."""
    spec = record.get("spec") or {}
    base = Path(spec.get("workdir") or cfg.install_dir)
    entry = base / "__main__.py" if spec.get("module") else Path(spec.get("entry") or "")
    if not entry.is_absolute():
        entry = base / entry
    roots = [str(entry.parent)]
    with contextlib.suppress(OSError):
        resolved = str(entry.resolve().parent)
        if resolved not in roots:
            roots.append(resolved)
    return roots


def _verdict(ranks: list[dict[str, Any]], returncode: int | None, running: bool, stop_requested: bool
             ) -> dict[str, Any]:
    failed = [r for r in ranks if r["class"] in ("user_code", "infrastructure", "unknown")]
    if not failed:
        if running or stop_requested or returncode in (None, 0):
            return {"class": "none", "kind": None, "rank": None, "local_rank": None, "evidence": None,
                    "exception": None, "first_failure": None}
        cls, kind = ("infrastructure", "signal") if returncode in (-9, -7) else ("unknown", None)
        return {"class": cls, "kind": kind, "rank": None, "local_rank": None, "exception": None,
                "evidence": f"torchrun exited with code {returncode}; no rank's log says why", "first_failure": None}
    primary = [r for r in failed if not r["secondary"]] or failed
    never = float("inf")
    primary.sort(key=lambda r: (r["failed_ts"] if r["failed_ts"] is not None else never, r["local_rank"]))
    first = primary[0]
    chosen = first
    if first["class"] == "unknown":
        for cls in ("user_code", "infrastructure"):
            better = [r for r in primary if r["class"] == cls]
            if better:
                chosen = better[0]
                break
    return {
        "class": chosen["class"],
        "kind": chosen["kind"],
        "rank": chosen["rank"],
        "local_rank": chosen["local_rank"],
        "evidence": chosen["evidence"],
        "exception": chosen["exception"],
        "first_failure": {"rank": first["rank"], "local_rank": first["local_rank"], "ts": first["failed_ts"],
                          "by": first["failed_ts_source"]},
    }


def logs(cfg: NodeConfig, job: str, *, since: float = 0.0, tail: int = 50,
         job_roots: list[str] | None = None) -> tuple[int, dict]:
    """How the newest incarnation of ``job`` on this machine is doing or ended, rank by rank.

    ``since``: only log files modified after this epoch time are read (older
    ranks are listed in ``skipped_local_ranks``). ``tail``: stderr lines per rank
    in the document (classification reads up to the last 512 KiB). ``job_roots``:
    the job's own code (default: the training script's directory). Raises
    TrainguardError (exit 2) for a job this machine does not know.
    """
    rd = jobmod.run_dir(cfg, job)
    try:
        record = json.loads((rd / "job.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        raise TrainguardError(f"machine {cfg.machine} has no job {job}") from None
    incarnation = record.get("incarnation")
    roots = list(job_roots) if job_roots is not None else job_roots_of(cfg, record)
    try:
        exit_doc = json.loads((rd / "exit.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        exit_doc = None
    running = bool(jobmod.job_pids(record))
    stop_requested = bool(record.get("stop_requested_ts")) and not running
    returncode = exit_doc.get("returncode") if exit_doc and not running else None

    report = None
    supervisor_log = rd / "supervisor.log"
    if (_mtime(supervisor_log) or 0) > since:
        report = parse_torchrun_report("\n".join(_read_tail(supervisor_log, 64 * 1024)),
                                       not_before=float(record.get("started_ts") or 0))
    exitcodes = {e["local_rank"]: e for e in (report or {}).get("failures", [])}
    if report and report.get("root_cause"):
        exitcodes.setdefault(report["root_cause"]["local_rank"], report["root_cause"])

    beats: dict[int, dict[str, Any]] = {}  # local rank -> heartbeat of this incarnation
    for path in (rd / "ranks").glob("rank*.json"):
        if path.name[4:-5].isdigit():
            hb = monitor.read_heartbeat(rd, int(path.name[4:-5]))
            if hb and hb.get("incarnation", incarnation) == incarnation and isinstance(hb.get("local_rank"), int):
                beats[hb["local_rank"]] = hb

    files = jobmod.rank_logs(cfg, job)
    ranks, skipped = [], []
    for local_rank in sorted(set(files) | set(beats)):
        stderr = files.get(local_rank, {}).get("stderr")
        mtime = _mtime(stderr)
        if since and (mtime is None or mtime <= since):
            skipped.append(local_rank)
            continue
        lines = _read_tail(stderr) if stderr else []
        hb = beats.get(local_rank) or {}
        failure = exitcodes.get(local_rank)
        exitcode = failure["exitcode"] if failure else (0 if returncode == 0 else None)
        verdict = classify(lines, roots, exitcode=exitcode)
        rank = hb.get("rank", failure["rank"] if failure else None)
        if rank is None:
            m = next((_PREFIX_RE.match(line) for line in lines if _PREFIX_RE.match(line)), None)
            digits = re.sub(r"\D", "", m.group(0)) if m else ""
            rank = int(digits) if digits else None
        cls = verdict["class"]
        from_log = cls != "none" and not (verdict["evidence"] or "").startswith("exit code")
        silent = False
        if cls == "none" and not running and returncode not in (None, 0) and hb.get("status") != "finished":
            if stop_requested:
                pass  # ended on request, and its log has no error
            else:
                # it did not finish, and says nothing: most often a rank torchrun ended after another failed
                cls, silent = "unknown", True
                verdict["evidence"] = (f"no error in its log; heartbeat status {hb.get('status')!r} "
                                       f"(ended by torchrun after another rank failed?)")
        failed_ts, source = None, None
        if cls != "none":
            if from_log:
                failed_ts, source = mtime, "stderr mtime"
            elif hb.get("alive_ts"):
                failed_ts, source = float(hb["alive_ts"]), "last heartbeat"
            elif failure and failure.get("time"):
                failed_ts, source = failure["time"], "torchrun report"
        ranks.append({
            "local_rank": local_rank,
            "rank": rank,
            "pid": hb.get("pid"),
            "stderr": str(stderr) if stderr else None,
            "stderr_mtime": mtime,
            "tail": [line.rstrip("\r\n") for line in lines[-tail:]] if tail > 0 else [],
            "heartbeat_status": hb.get("status"),
            "step": hb.get("step"),
            "exitcode": failure["exitcode"] if failure else None,
            "class": cls,
            "kind": verdict["kind"],
            "evidence": verdict["evidence"],
            "exception": verdict["exception"],
            "user_frame": verdict["user_frame"],
            # an error that only echoes another rank's end (its connection closed); not a first failure
            "secondary": silent or (cls == "infrastructure" and verdict["kind"] == "peer_connection"),
            "failed_ts": failed_ts,
            "failed_ts_source": source,
        })
    document = {
        "job": job,
        "machine": cfg.machine,
        "incarnation": incarnation,
        "state": "running" if running else "exited",
        "stop_requested": stop_requested,
        "returncode": returncode,
        "ended_ts": exit_doc.get("ended_ts") if exit_doc and not running else None,
        "since": since,
        "job_roots": roots,
        "verdict": _verdict(ranks, returncode, running, stop_requested),
        "ranks": ranks,
        "skipped_local_ranks": skipped,
        "torchrun_report": report,
    }
    return EXIT_OK, document
