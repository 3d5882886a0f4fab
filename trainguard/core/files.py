"""The one way trainguard writes a file that someone else may read at the same time.

A reader sees the old file or the new one, never a part: the bytes go to a temporary file beside the
target (or in ``tmp_dir``, on the same file system, for spools whose readers list the target's folder),
named uniquely per process and thread, are flushed (and forced to disk with ``fsync``), and the
temporary is renamed over the target. If anything fails the temporary is removed and the target is
untouched. The checkpoint library, the node tools and the control plane all write through it.
"""

from __future__ import annotations

import json
import os
import threading
import uuid
from pathlib import Path
from typing import Any


def write_atomic(path: Path | str, data: bytes | str, *, fsync: bool = False, make_parent: bool = True,
                 tmp_dir: Path | None = None, mode: int = 0o666) -> None:
    """Replace ``path`` with ``data`` atomically (see the module). ``make_parent``: create its folder
    first (off: a missing folder raises FileNotFoundError, e.g. a checkpoint copy removed meanwhile).
    ``mode``: the file's permissions (less the umask) from its creation on, e.g. 0o600 for a secret."""
    path = Path(path)
    if make_parent:
        path.parent.mkdir(parents=True, exist_ok=True)
    name = f".{path.name}.{os.getpid()}.{threading.get_ident()}.{uuid.uuid4().hex[:6]}.tmp"
    tmp = (tmp_dir or path.parent) / name
    body = data.encode("utf-8") if isinstance(data, str) else data
    try:
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode), "wb") as fh:
            fh.write(body)
            fh.flush()
            if fsync:
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_json_atomic(path: Path | str, document: Any, *, indent: int | None = None, sort_keys: bool = False,
                      compact: bool = False, fsync: bool = False, make_parent: bool = True) -> None:
    """``document`` as JSON (``compact``: no spaces; ``indent``: indented, with a final newline), through
    :func:`write_atomic`."""
    text = json.dumps(document, indent=indent, sort_keys=sort_keys, separators=(",", ":") if compact else None)
    write_atomic(path, text + ("\n" if indent is not None else ""), fsync=fsync, make_parent=make_parent)
