"""The remote tier: rank copies under ``s3://bucket/prefix/step_<N>/rank_<R>/`` through boto3 (any
endpoint), or under ``file:///shared/dir/step_<N>/rank_<R>/`` on a directory every machine mounts (shared
storage: NFS, Lustre, a host directory of the emulated cluster). :func:`open_tier` picks by the URL; both
have the same interface, and the rest of the library calls the remote tier "s3" whatever holds it.

An object (file) per state file, the manifest written last (a copy without one is
incomplete and ignored), ``verified.json`` added by verification. Every S3 request
has short connect/read timeouts and few retries: an endpoint that is down costs
seconds, is reported as one :class:`S3TierError` line naming the endpoint, and
never blocks training (uploads run on a background thread). A directory tier writes
each file through a temporary name and a rename, so a reader sees it whole or not
at all.
"""

from __future__ import annotations

import base64
import hashlib
import os
import re
import shutil
import urllib.parse
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainguard.checkpoint.errors import S3TierError
from trainguard.checkpoint.layout import VERIFIED
from trainguard.checkpoint.manifest import MANIFEST
from trainguard.core.files import write_atomic

_KEY_RE = re.compile(r"step_(\d+)/rank_(\d+)/([^/]+)$")


def split_url(url: str) -> tuple[str, str]:
    """``s3://bucket/some/prefix`` -> ``("bucket", "some/prefix")``."""
    if not url.startswith("s3://"):
        raise S3TierError(f"S3 location {url!r} must look like s3://bucket/prefix")
    bucket, _, prefix = url[5:].partition("/")
    if not bucket:
        raise S3TierError(f"S3 location {url!r} names no bucket")
    return bucket, prefix.strip("/")


@dataclass
class S3Tier:
    """One S3 location of checkpoint copies.

    Attributes:
        url: ``s3://bucket/prefix``.
        endpoint_url: the S3-compatible endpoint; "" = boto3's default.
        timeout_s: connect and read timeout of each request. Seconds.
        attempts: tries per request (boto3 "standard" retry mode).
    """

    url: str
    endpoint_url: str = ""
    timeout_s: float = 5.0
    attempts: int = 2
    client_: Any = None  # a ready boto3 S3 client (the control plane's, from its Airflow connection)

    def __post_init__(self) -> None:
        self.bucket, self.prefix = split_url(self.url)
        self._client: Any = self.client_

    @property
    def where(self) -> str:
        return f"{self.url}" + (f" at {self.endpoint_url}" if self.endpoint_url else "")

    def client(self) -> Any:
        if self._client is None:
            import boto3
            from botocore.config import Config

            cfg = Config(connect_timeout=self.timeout_s, read_timeout=self.timeout_s,
                         retries={"max_attempts": self.attempts, "mode": "standard"})
            self._client = boto3.client("s3", endpoint_url=self.endpoint_url or None, config=cfg)
        return self._client

    def key(self, step: int, rank: int, name: str) -> str:
        rel = f"step_{step}/rank_{rank}/{name}"
        return f"{self.prefix}/{rel}" if self.prefix else rel

    def copy_url(self, step: int, rank: int) -> str:
        return f"s3://{self.bucket}/{self.key(step, rank, '')}"

    def _call(self, what: str, fn: Any, **kwargs: Any) -> Any:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return fn(**kwargs)
        except ClientError as exc:
            code = exc.response.get("Error", {}).get("Code", "?")
            raise S3TierError(f"S3 tier {self.where}: {what} refused ({code})") from None
        except BotoCoreError as exc:
            raise S3TierError(f"S3 tier {self.where}: {what} failed: {type(exc).__name__}: {exc}") from None

    # ---- writing --------------------------------------------------------------------------
    def upload_copy(self, step: int, rank: int, files: Iterable[tuple[str, bytes]], manifest: bytes) -> None:
        """Upload a rank's copy of a step: the tensor files, then the manifest. Each object carries an
        S3-side SHA-256 checksum of its body (the store refuses a body that does not match it, and
        reports it later: :meth:`remote_checksums`)."""
        c = self.client()
        for name, data in files:
            self._call(f"upload of {self.key(step, rank, name)}", c.put_object, Bucket=self.bucket,
                       Key=self.key(step, rank, name), Body=data, ChecksumAlgorithm="SHA256")
        self._call(f"upload of {self.key(step, rank, MANIFEST)}", c.put_object, Bucket=self.bucket,
                   Key=self.key(step, rank, MANIFEST), Body=manifest, ChecksumAlgorithm="SHA256")

    def put(self, step: int, rank: int, name: str, data: bytes) -> None:
        self._call(f"upload of {self.key(step, rank, name)}", self.client().put_object, Bucket=self.bucket,
                   Key=self.key(step, rank, name), Body=data)

    def delete_copy(self, step: int, rank: int) -> None:
        c = self.client()
        keys = [k for k in self._keys(f"step_{step}/rank_{rank}/")]
        for start in range(0, len(keys), 1000):
            self._call(f"delete of {self.copy_url(step, rank)}", c.delete_objects, Bucket=self.bucket,
                       Delete={"Objects": [{"Key": k} for k in keys[start:start + 1000]], "Quiet": True})

    # ---- reading --------------------------------------------------------------------------
    def _keys(self, under: str = "") -> Iterable[str]:
        c = self.client()
        base = f"{self.prefix}/" if self.prefix else ""
        token = None
        while True:
            kwargs: dict[str, Any] = {"Bucket": self.bucket, "Prefix": base + under}
            if token:
                kwargs["ContinuationToken"] = token
            page = self._call(f"listing of s3://{self.bucket}/{base}{under}", c.list_objects_v2, **kwargs)
            for obj in page.get("Contents", []):
                yield obj["Key"]
            if not page.get("IsTruncated"):
                return
            token = page.get("NextContinuationToken")

    def list_copies(self) -> dict[tuple[int, int], set[str]]:
        """Every ``(step, rank)`` with the names of its objects; only copies that have a manifest."""
        found: dict[tuple[int, int], set[str]] = {}
        for key in self._keys():
            m = _KEY_RE.search(key)
            if m:
                found.setdefault((int(m.group(1)), int(m.group(2))), set()).add(m.group(3))
        return {k: v for k, v in found.items() if MANIFEST in v}

    def get(self, step: int, rank: int, name: str) -> bytes | None:
        """An object's bytes, or None when it does not exist."""
        from botocore.exceptions import ClientError

        key = self.key(step, rank, name)
        try:
            obj = self.client().get_object(Bucket=self.bucket, Key=key)
            return obj["Body"].read()
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                return None
            code = exc.response.get("Error", {}).get("Code", "?")
            raise S3TierError(f"S3 tier {self.where}: download of {key} refused ({code})") from None
        except Exception as exc:  # botocore connection errors, read timeouts
            raise S3TierError(f"S3 tier {self.where}: download of {key} failed: {type(exc).__name__}: {exc}") from None

    def is_verified(self, step: int, rank: int) -> bool:
        return self.get(step, rank, VERIFIED) is not None

    def remote_checksums(self, step: int, rank: int, name: str) -> tuple[str, int] | None:
        """``(sha256 hex, size)`` the store reports for an object (no download), or None when it has no
        SHA-256 checksum for it (uploaded without one) or the object does not exist."""
        from botocore.exceptions import ClientError

        key = self.key(step, rank, name)
        try:
            attrs = self.client().get_object_attributes(Bucket=self.bucket, Key=key,
                                                        ObjectAttributes=["Checksum", "ObjectSize"])
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                return None
            code = exc.response.get("Error", {}).get("Code", "?")
            raise S3TierError(f"S3 tier {self.where}: attributes of {key} refused ({code})") from None
        except Exception as exc:  # connection errors, timeouts
            raise S3TierError(f"S3 tier {self.where}: attributes of {key} failed: "
                              f"{type(exc).__name__}: {exc}") from None
        b64 = (attrs.get("Checksum") or {}).get("ChecksumSHA256")
        if not b64 or "-" in b64:  # a multipart object's checksum is of its parts, not of the body
            return None
        return base64.b64decode(b64).hex(), int(attrs.get("ObjectSize", -1))

    def steps(self) -> dict[int, dict[int, bool]]:
        """Every step with copies here: ``{step: {rank: verified}}`` (copies with a manifest only)."""
        out: dict[int, dict[int, bool]] = {}
        for (step, rank), names in self.list_copies().items():
            out.setdefault(step, {})[rank] = VERIFIED in names
        return out


@dataclass
class DirTier:
    """The remote tier on a shared directory (``file:///path``): the same interface as :class:`S3Tier`.

    Attributes:
        url: ``file:///absolute/path``.
        fsync: fsync every file before its rename (off only for throwaway runs).
    """

    url: str
    fsync: bool = True

    def __post_init__(self) -> None:
        parsed = urllib.parse.urlparse(self.url)
        if parsed.scheme != "file" or not parsed.path.startswith("/") or parsed.netloc:
            raise S3TierError(f"directory tier {self.url!r} must look like file:///absolute/path")
        self.root = Path(parsed.path)

    @property
    def where(self) -> str:
        return self.url

    def _dir(self, step: int, rank: int) -> Path:
        return self.root / f"step_{step}" / f"rank_{rank}"

    def key(self, step: int, rank: int, name: str) -> str:
        return str(self._dir(step, rank) / name)

    def copy_url(self, step: int, rank: int) -> str:
        return f"file://{self._dir(step, rank)}/"

    def _write(self, path: Path, data: bytes) -> None:
        try:
            write_atomic(path, data, fsync=self.fsync)
        except OSError as exc:
            raise S3TierError(f"directory tier {self.url}: write of {path} failed ({exc.strerror or exc})") from None

    def upload_copy(self, step: int, rank: int, files: Iterable[tuple[str, bytes]], manifest: bytes) -> None:
        """Write a rank's copy of a step: the state files, then the manifest."""
        from trainguard.checkpoint.manifest import MANIFEST

        for name, data in files:
            self._write(self._dir(step, rank) / name, bytes(data))
        self._write(self._dir(step, rank) / MANIFEST, manifest)

    def put(self, step: int, rank: int, name: str, data: bytes) -> None:
        self._write(self._dir(step, rank) / name, data)

    def delete_copy(self, step: int, rank: int) -> None:
        d = self._dir(step, rank)
        trash = d.with_name(f".trash-{d.name}-{uuid.uuid4().hex[:8]}")
        try:
            os.replace(d, trash)
        except FileNotFoundError:
            return
        except OSError as exc:
            raise S3TierError(f"directory tier {self.url}: delete of {d} failed ({exc.strerror or exc})") from None
        shutil.rmtree(trash, ignore_errors=True)

    def list_copies(self) -> dict[tuple[int, int], set[str]]:
        """Every ``(step, rank)`` with the names of its files; only copies that have a manifest."""
        from trainguard.checkpoint.manifest import MANIFEST

        found: dict[tuple[int, int], set[str]] = {}
        try:
            step_dirs = list(self.root.iterdir())
        except FileNotFoundError:
            return {}
        except OSError as exc:
            raise S3TierError(f"directory tier {self.url}: listing failed ({exc.strerror or exc})") from None
        for sd in step_dirs:
            s = re.fullmatch(r"step_(\d+)", sd.name)
            if not s or not sd.is_dir():
                continue
            for rd in sd.iterdir():
                r = re.fullmatch(r"rank_(\d+)", rd.name)
                if r and rd.is_dir():
                    names = {f.name for f in rd.iterdir() if not f.name.startswith(".")}
                    if MANIFEST in names:
                        found[(int(s.group(1)), int(r.group(1)))] = names
        return found

    def get(self, step: int, rank: int, name: str) -> bytes | None:
        try:
            return (self._dir(step, rank) / name).read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise S3TierError(f"directory tier {self.url}: read of {self.key(step, rank, name)} failed "
                              f"({exc.strerror or exc})") from None

    def is_verified(self, step: int, rank: int) -> bool:
        return (self._dir(step, rank) / VERIFIED).exists()

    def remote_checksums(self, step: int, rank: int, name: str) -> tuple[str, int] | None:
        """``(sha256 hex, size)`` of a file, or None when it does not exist."""
        data = self.get(step, rank, name)
        return None if data is None else (hashlib.sha256(data).hexdigest(), len(data))

    def steps(self) -> dict[int, dict[int, bool]]:
        out: dict[int, dict[int, bool]] = {}
        for (step, rank), names in self.list_copies().items():
            out.setdefault(step, {})[rank] = VERIFIED in names
        return out


def open_tier(url: str, *, endpoint_url: str = "", timeout_s: float = 5.0, client: Any = None) -> S3Tier | DirTier:
    """The remote tier at ``url``: ``s3://bucket/prefix`` (``endpoint_url``: an S3-compatible store) or
    ``file:///shared/dir``."""
    if url.startswith("file://"):
        return DirTier(url)
    return S3Tier(url, endpoint_url=endpoint_url, timeout_s=timeout_s, client_=client)
