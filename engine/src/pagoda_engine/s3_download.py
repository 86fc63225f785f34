"""Download a model from S3-compatible storage: `python -m pagoda_engine.s3_download s3://bucket/prefix DEST`.

The engine pod's init container runs this for an `s3://` model URI (the operator renders it; the
engine image has this package), as it runs `hf download` for an `hf://` one. Every object under
`prefix/` lands at DEST/<its key below the prefix>; the engine then reads DEST as a local model
directory.

Where the store is and who we are come from the environment, as every AWS SDK reads them:
AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN, AWS_ENDPOINT_URL (any
S3-compatible store: MinIO, Ceph, R2, GCS's XML API; path-style addressing then, which all of
them serve), AWS_REGION; without keys, boto3's chain finds the pod's service-account role (EKS
IRSA or Pod Identity) or the node's.

Resumable and checked:
  - a file already complete (its size, and the ETag it was downloaded at, recorded in
    DEST/.pagoda-s3/etags.json) is skipped without a request;
  - an interrupted file resumes from the bytes already on disk (a ranged GET, If-Match the same
    ETag, so a changed object starts over), kept under DEST/.pagoda-s3/parts/ until complete;
  - a finished file's size must be the object's, and its MD5 the ETag where the ETag is a plain
    MD5 (single-part upload, no KMS or customer-key encryption); a mismatch discards it and the
    attempt fails.

Exit codes: 0 done; 1 the store failed and kept failing over --retries attempts (network,
5xx, a file that did not check out); 2 bad arguments; 3 refused, which no retry fixes (wrong or
missing credentials, no access, no such bucket, nothing under the prefix). The last line on
stderr says why; the init container's termination message (FallbackToLogsOnError) carries it to
the pod's status.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import re
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

log = logging.getLogger("pagoda.s3_download")

EXIT_FAILED, EXIT_REFUSED = 1, 3  # and argparse's 2 for bad arguments
CHUNK_BYTES = 8 * 1024 * 1024
STATE_DIR = ".pagoda-s3"
_PLAIN_MD5 = re.compile(r"^[0-9a-f]{32}$")
# S3 error codes no retry can fix: who we are, what we may read, what exists.
_REFUSALS = {"AccessDenied", "AllAccessDisabled", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken",
             "InvalidToken", "TokenRefreshRequired", "NoSuchBucket", "InvalidBucketName", "403", "404",
             "AuthorizationHeaderMalformed", "InvalidClientTokenId", "UnrecognizedClientException"}


class DownloadRefused(Exception):
    """The store refused us, or there is nothing to download: retrying cannot help."""


class DownloadFailed(Exception):
    """This attempt failed (network, server, a file that did not check out); a later one may not."""


def parse_s3_uri(uri: str) -> tuple[str, str]:
    """(bucket, prefix without slashes at its ends) of `s3://bucket[/prefix]`."""
    if not uri.startswith("s3://"):
        raise ValueError(f"{uri!r} is not an s3:// URI (s3://bucket/prefix)")
    bucket, _, prefix = uri[len("s3://"):].partition("/")
    if not re.fullmatch(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]", bucket):
        raise ValueError(f"{uri!r}: {bucket!r} is not an S3 bucket name (3-63 of a-z 0-9 . -)")
    return bucket, prefix.strip("/")


@dataclass(frozen=True)
class RemoteFile:
    key: str
    path: str  # below DEST, with "/" separators
    size: int
    etag: str  # without its quotes


def _local_path(key: str, prefix: str) -> str:
    rel = key[len(prefix):].lstrip("/") if prefix else key
    parts = PurePosixPath(rel).parts
    if not parts or any(p in ("..", ".") for p in parts) or rel.startswith("/") or parts[0] == STATE_DIR:
        raise DownloadRefused(f"object key {key!r} does not name a file below the prefix; refusing to write it")
    return rel


def list_files(client, bucket: str, prefix: str) -> list[RemoteFile]:
    """Every object under `prefix/` (folder markers, keys ending in "/", left out)."""
    files = []
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=f"{prefix}/" if prefix else "")
    for page in pages:
        for obj in page.get("Contents", ()):
            if not obj["Key"].endswith("/"):
                files.append(RemoteFile(obj["Key"], _local_path(obj["Key"], prefix), obj["Size"],
                                        obj["ETag"].strip('"')))
    if not files:
        raise DownloadRefused(f"s3://{bucket}/{prefix} holds no objects: check the URI")
    return files


class Destination:
    """DEST and what is known about it: the ETag each complete file was downloaded at."""

    def __init__(self, root: Path):
        self.root = root
        self.state = root / STATE_DIR
        self.parts = self.state / "parts"
        self.parts.mkdir(parents=True, exist_ok=True)
        self._etags_file = self.state / "etags.json"
        self._lock = threading.Lock()
        try:
            self._etags: dict[str, str] = json.loads(self._etags_file.read_text())
        except (OSError, ValueError):
            self._etags = {}

    def is_complete(self, f: RemoteFile) -> bool:
        target = self.root / f.path
        return self._etags.get(f.path) == f.etag and target.is_file() and target.stat().st_size == f.size

    def part_path(self, f: RemoteFile) -> Path:
        """Where `f`'s bytes gather until it is complete; named by key and ETag, so the part of
        an object that has since changed is never resumed."""
        return self.parts / (hashlib.sha256(f"{f.key}\0{f.etag}".encode()).hexdigest()[:40] + ".part")

    def finish(self, f: RemoteFile, part: Path) -> None:
        target = self.root / f.path
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(part, target)
        with self._lock:
            self._etags[f.path] = f.etag
            tmp = self._etags_file.with_suffix(".tmp")
            tmp.write_text(json.dumps(self._etags, indent=1, sort_keys=True))
            os.replace(tmp, self._etags_file)

    def clear_parts(self) -> None:
        for part in self.parts.iterdir():
            part.unlink()


def _client_error(e) -> Exception:
    """A botocore ClientError as a refusal or a failure."""
    error = e.response.get("Error", {})
    code = str(error.get("Code", ""))
    status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    what = f"{code or status}: {error.get('Message') or e}"
    if code in _REFUSALS or status in (401, 403):
        return DownloadRefused(f"the store refused the request ({what}); check the credentials in the referenced "
                               f"Secret (or the service account's role), its access to the bucket, and the URI")
    return DownloadFailed(what)


def download_file(client, bucket: str, f: RemoteFile, dest: Destination, deadline: float) -> int:
    """Fetch `f` (the rest of it, when a part is on disk), check it, put it in place. The bytes fetched."""
    part = dest.part_path(f)
    part.touch()
    have = part.stat().st_size
    if have > f.size:
        part.write_bytes(b"")
        have = 0
    md5 = hashlib.md5()
    if have:
        with open(part, "rb") as existing:
            while chunk := existing.read(CHUNK_BYTES):
                md5.update(chunk)
        log.info("%s: resuming at %d of %d bytes", f.path, have, f.size)
    checks_md5 = bool(_PLAIN_MD5.match(f.etag))
    fetched = 0
    if have < f.size:
        request = {"Bucket": bucket, "Key": f.key, "IfMatch": f'"{f.etag}"'}
        if have:
            request["Range"] = f"bytes={have}-"
        try:
            response = client.get_object(**request)
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("PreconditionFailed", "412"):
                raise DownloadFailed(f"{f.key} changed while it was being downloaded") from None
            raise _client_error(e) from None
        # KMS and customer-key encryption make the ETag something other than the MD5.
        checks_md5 = checks_md5 and response.get("ServerSideEncryption") != "aws:kms" \
            and not response.get("SSECustomerAlgorithm")
        with open(part, "ab") as out:
            for chunk in response["Body"].iter_chunks(CHUNK_BYTES):
                out.write(chunk)
                md5.update(chunk)
                fetched += len(chunk)
                if time.monotonic() > deadline:
                    raise DownloadFailed(f"the attempt ran past --attempt-timeout while fetching {f.key}")
    size = part.stat().st_size
    if size != f.size:
        part.unlink()
        raise DownloadFailed(f"{f.key}: got {size} bytes, the object has {f.size}; discarded")
    if checks_md5 and md5.hexdigest() != f.etag:
        part.unlink()
        raise DownloadFailed(f"{f.key}: MD5 {md5.hexdigest()} is not the object's ETag {f.etag}; discarded")
    dest.finish(f, part)
    log.info("%s: %d bytes%s", f.path, f.size, ", MD5 checked" if checks_md5 else "")
    return fetched


def download(client, uri: str, dest_dir: Path, parallel: int = 4, attempt_timeout_s: float = 3600.0) -> dict:
    """One attempt at the whole model: what was skipped, fetched and resumed."""
    bucket, prefix = parse_s3_uri(uri)
    deadline = time.monotonic() + attempt_timeout_s
    try:
        files = list_files(client, bucket, prefix)
    except NoCredentialsError:
        raise DownloadRefused("no credentials: reference a Secret holding AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
                              "or give the pod's service account a role that may read the bucket") from None
    except ClientError as e:
        raise _client_error(e) from None
    except BotoCoreError as e:
        raise DownloadFailed(f"{type(e).__name__}: {e}") from None
    dest = Destination(dest_dir)
    todo = [f for f in files if not dest.is_complete(f)]
    log.info("%s: %d files, %d bytes; %d complete already", uri, len(files), sum(f.size for f in files),
             len(files) - len(todo))
    with ThreadPoolExecutor(max(1, parallel)) as pool:
        futures = [pool.submit(download_file, client, bucket, f, dest, deadline) for f in todo]
        errors = []
        fetched = 0
        for future in futures:
            try:
                fetched += future.result()
            except (DownloadRefused, DownloadFailed) as e:
                errors.append(e)
            except BotoCoreError as e:
                errors.append(DownloadFailed(f"{type(e).__name__}: {e}"))
    if errors:  # a refusal first: no retry would fix it
        raise next((e for e in errors if isinstance(e, DownloadRefused)), errors[0])
    dest.clear_parts()
    return {"files": len(files), "skipped": len(files) - len(todo), "fetched_bytes": fetched}


def make_client():
    """An S3 client configured from the environment (see the module docstring). botocore retries
    each request a little itself (throttling, a 5xx); `main` retries whole attempts, resuming."""
    custom_endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    config = Config(retries={"max_attempts": 3, "mode": "standard"}, connect_timeout=10, read_timeout=60,
                    s3={"addressing_style": "path"} if custom_endpoint else {})
    return boto3.session.Session().client("s3", config=config)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagoda_engine.s3_download",
                                     description="Download a model from S3-compatible storage, resumably.")
    parser.add_argument("uri", help="s3://bucket/prefix: every object below the prefix")
    parser.add_argument("dest", help="the directory the files land in (keys below the prefix become paths)")
    parser.add_argument("--retries", type=int, default=3, help="attempts after the first one fails (default 3)")
    parser.add_argument("--attempt-timeout", type=float, default=3600.0,
                        help="seconds one attempt may take; the next resumes where it stopped (default 3600)")
    parser.add_argument("--parallel", type=int, default=4, help="files fetched at once (default 4)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="pagoda s3: %(message)s", stream=sys.stdout)
    log.setLevel(logging.INFO)  # this module's progress; boto3's own INFO lines are noise here
    try:
        parse_s3_uri(args.uri)
    except ValueError as e:
        parser.error(str(e))
    for flag, value, low in (("--retries", args.retries, 0), ("--parallel", args.parallel, 1),
                             ("--attempt-timeout", args.attempt_timeout, 1)):
        if value < low:
            parser.error(f"{flag} must be >= {low}, got {value}")
    client = make_client()
    for attempt in range(args.retries + 1):
        try:
            result = download(client, args.uri, Path(args.dest), args.parallel, args.attempt_timeout)
        except DownloadRefused as e:
            print(f"pagoda s3: downloading {args.uri} refused: {e}", file=sys.stderr, flush=True)
            return EXIT_REFUSED
        except DownloadFailed as e:
            if attempt == args.retries:
                print(f"pagoda s3: downloading {args.uri} failed {attempt + 1} times; giving up: {e}",
                      file=sys.stderr, flush=True)
                return EXIT_FAILED
            wait = min(60, 5 * (attempt + 1))
            log.warning("attempt %d failed (%s); resuming in %ds", attempt + 1, e, wait)
            time.sleep(wait)
            continue
        log.info("done: %d files (%d complete already), %d bytes fetched", result["files"], result["skipped"],
                 result["fetched_bytes"])
        return 0
    return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
