"""`python -m pagoda_engine.s3_download` (the init container of an s3:// model) against a real S3
server on this machine: moto in server mode, started once for the module, with authentication
on (only the access key made in its IAM may read), and the downloader run as the init container
runs it, a process configured by AWS_* variables. An interruption is a real one: a proxy that
breaks the connection mid-file, or the part file an interrupted run leaves."""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import socket
import subprocess
import sys
import threading
from pathlib import Path

import boto3
import pytest

from pagoda_engine.s3_download import Destination, RemoteFile

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "e2e" / "local"))
from pagoda_e2e import Proc, free_port  # noqa: E402  (the process harness of e2e/local)

BUCKET = "models"
PREFIX = "org/tiny-model"
MIB = 1024 * 1024
# A model's files: small ones, a nested one, one large enough to resume within, and one uploaded
# in parts (its ETag is not an MD5: only its size can be checked).
FILES = {
    "config.json": b'{"model_type": "llama"}',
    "tokenizer/tokenizer.json": b'{"version": "1.0"}' * 100,
    "model.safetensors": bytes(range(256)) * (12 * MIB // 256),
    "model-00002.safetensors": os.urandom(11 * MIB),
    "empty.txt": b"",
}
MULTIPART = "model-00002.safetensors"


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("moto")
    port = free_port()
    # The first three requests (making the IAM user, its policy and key) go unauthenticated; every
    # later one needs a key moto's IAM knows.
    server = Proc([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], tmp / "moto.log",
                  env={"INITIAL_NO_AUTH_ACTION_COUNT": "3"})
    endpoint = f"http://127.0.0.1:{port}"
    try:
        server.wait_http(endpoint + "/moto-api/", timeout=60)
        anonymous = {"endpoint_url": endpoint, "region_name": "us-east-1", "aws_access_key_id": "setup",
                     "aws_secret_access_key": "setup"}
        iam = boto3.client("iam", **anonymous)
        iam.create_user(UserName="reader")
        iam.put_user_policy(UserName="reader", PolicyName="s3", PolicyDocument='{"Version": "2012-10-17", "Statement": '
                            '[{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}')
        key = iam.create_access_key(UserName="reader")["AccessKey"]
        env = {"AWS_ENDPOINT_URL": endpoint, "AWS_REGION": "us-east-1", "AWS_ACCESS_KEY_ID": key["AccessKeyId"],
               "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"], "AWS_EC2_METADATA_DISABLED": "true"}
        client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                              aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                              aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"])
        client.create_bucket(Bucket=BUCKET)
        for name, data in FILES.items():
            if name != MULTIPART:
                client.put_object(Bucket=BUCKET, Key=f"{PREFIX}/{name}", Body=data)
        upload = client.create_multipart_upload(Bucket=BUCKET, Key=f"{PREFIX}/{MULTIPART}")
        data = FILES[MULTIPART]
        parts = []
        for number, start in enumerate(range(0, len(data), 6 * MIB), 1):
            etag = client.upload_part(Bucket=BUCKET, Key=f"{PREFIX}/{MULTIPART}", PartNumber=number,
                                      UploadId=upload["UploadId"], Body=data[start:start + 6 * MIB])["ETag"]
            parts.append({"PartNumber": number, "ETag": etag})
        client.complete_multipart_upload(Bucket=BUCKET, Key=f"{PREFIX}/{MULTIPART}", UploadId=upload["UploadId"],
                                         MultipartUpload={"Parts": parts})
        client.put_object(Bucket=BUCKET, Key=f"{PREFIX}/folder/", Body=b"")  # a console's folder marker
        client.put_object(Bucket=BUCKET, Key=f"{PREFIX}-v2/config.json", Body=b"{}")  # beside the prefix, not in it
        yield {"env": env, "client": client, "endpoint": endpoint}
    finally:
        server.stop()


def run(dest: Path, env: dict, uri: str = f"s3://{BUCKET}/{PREFIX}", *flags: str) -> subprocess.CompletedProcess:
    # Only the variables the operator sets: no credentials or configuration of this machine's.
    base = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    return subprocess.run([sys.executable, "-m", "pagoda_engine.s3_download", uri, str(dest), *flags],
                          env={**base, "AWS_CONFIG_FILE": "/dev/null", "AWS_SHARED_CREDENTIALS_FILE": "/dev/null", **env},
                          capture_output=True, text=True, timeout=120)


def assert_model_in(dest: Path) -> None:
    got = {str(p.relative_to(dest)): p.read_bytes() for p in dest.rglob("*") if p.is_file()
           and ".pagoda-s3" not in p.parts}
    assert got == FILES
    assert not any((dest / ".pagoda-s3" / "parts").iterdir())


def remote(s3, name: str) -> RemoteFile:
    head = s3["client"].head_object(Bucket=BUCKET, Key=f"{PREFIX}/{name}")
    return RemoteFile(f"{PREFIX}/{name}", name, head["ContentLength"], head["ETag"].strip('"'))


def test_a_fresh_download_lands_every_file_below_the_prefix(s3, tmp_path):
    out = run(tmp_path / "model", s3["env"])
    assert out.returncode == 0, out.stderr
    assert_model_in(tmp_path / "model")
    total = sum(map(len, FILES.values()))
    assert f"done: {len(FILES)} files (0 complete already), {total} bytes fetched" in out.stdout
    assert "model.safetensors: 12582912 bytes, MD5 checked" in out.stdout
    assert f"{MULTIPART}: 11534336 bytes\n" in out.stdout  # a multipart ETag is no MD5: its size is checked

    again = run(tmp_path / "model", s3["env"])
    assert again.returncode == 0, again.stderr
    assert f"done: {len(FILES)} files ({len(FILES)} complete already), 0 bytes fetched" in again.stdout


class CuttingProxy:
    """A TCP proxy in front of the S3 server that breaks the connection carrying the first GET of
    `key`, `after` bytes into its response: a network failure mid-file."""

    def __init__(self, upstream_port: int, key: str, after: int):
        self.upstream_port, self.needle, self.after = upstream_port, f"GET /{BUCKET}/{key}".encode(), after
        self.cut = threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.upstream_port))
            budget = {"left": None}  # bytes of response this connection may still pass, once it is the one to cut
            threading.Thread(target=self._requests, args=(client, server, budget), daemon=True).start()
            threading.Thread(target=self._responses, args=(server, client, budget), daemon=True).start()

    def _requests(self, client, server, budget) -> None:
        with contextlib.suppress(OSError):
            while data := client.recv(65536):
                if self.needle in data and not self.cut.is_set():
                    self.cut.set()
                    budget["left"] = self.after
                server.sendall(data)

    def _responses(self, server, client, budget) -> None:
        with contextlib.suppress(OSError):
            while data := server.recv(65536):
                if budget["left"] is not None:
                    data = data[:budget["left"]]
                    budget["left"] -= len(data)
                client.sendall(data)
                if budget["left"] == 0:
                    break
        for sock in (client, server):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def close(self) -> None:
        self.listener.close()


def test_a_download_broken_mid_file_resumes_from_the_bytes_it_kept(s3, tmp_path):
    size = len(FILES["model.safetensors"])
    proxy = CuttingProxy(int(s3["endpoint"].rsplit(":", 1)[1]), f"{PREFIX}/model.safetensors", after=10 * MIB)
    try:
        out = run(tmp_path / "model", {**s3["env"], "AWS_ENDPOINT_URL": f"http://127.0.0.1:{proxy.port}"},
                  f"s3://{BUCKET}/{PREFIX}", "--parallel", "1")
    finally:
        proxy.close()
    assert proxy.cut.is_set()
    assert out.returncode == 0, out.stderr
    assert "attempt 1 failed" in out.stdout
    # what arrived before the break (10 MiB less the response's headers) stayed on disk; the
    # second attempt asked for the rest only
    kept = int(re.search(rf"model.safetensors: resuming at (\d+) of {size} bytes", out.stdout)[1])
    assert 10 * MIB - 4096 < kept < 10 * MIB
    assert f"done: {len(FILES)} files ({len(FILES) - 1} complete already), {size - kept} bytes fetched" in out.stdout
    assert_model_in(tmp_path / "model")


def test_an_interrupted_download_resumes_from_the_bytes_on_disk(s3, tmp_path):
    dest = tmp_path / "model"
    first = run(dest, s3["env"])  # the model, then one file as an interrupted attempt leaves it
    assert first.returncode == 0, first.stderr
    big = remote(s3, "model.safetensors")
    (dest / "model.safetensors").unlink()
    have = 5 * MIB + 123
    Destination(dest).part_path(big).write_bytes(FILES["model.safetensors"][:have])

    out = run(dest, s3["env"])
    assert out.returncode == 0, out.stderr
    assert f"model.safetensors: resuming at {have} of {big.size} bytes" in out.stdout
    assert f"done: {len(FILES)} files ({len(FILES) - 1} complete already), {big.size - have} bytes fetched" in out.stdout
    assert_model_in(dest)
    assert hashlib.md5((dest / "model.safetensors").read_bytes()).hexdigest() == big.etag


def test_a_resumed_file_that_does_not_match_its_md5_is_fetched_again(s3, tmp_path):
    dest = tmp_path / "model"
    big = remote(s3, "model.safetensors")
    wrong = bytes(4 * MIB)  # bytes the object does not have
    Destination(dest).part_path(big).write_bytes(wrong)
    out = run(dest, s3["env"])
    assert out.returncode == 0, out.stderr
    got = hashlib.md5(wrong + FILES["model.safetensors"][len(wrong):]).hexdigest()
    assert f"model.safetensors: MD5 {got} is not the object's ETag {big.etag}; discarded" in out.stdout
    assert "attempt 1 failed" in out.stdout  # then fetched whole by the next attempt
    assert_model_in(dest)


def test_a_file_changed_on_disk_is_fetched_again(s3, tmp_path):
    dest = tmp_path / "model"
    assert run(dest, s3["env"]).returncode == 0
    (dest / "config.json").write_bytes(b"{}")
    out = run(dest, s3["env"])
    assert out.returncode == 0, out.stderr
    assert f"done: {len(FILES)} files ({len(FILES) - 1} complete already), {len(FILES['config.json'])} bytes" in out.stdout
    assert_model_in(dest)


@pytest.mark.parametrize("change, words", [
    ({"AWS_SECRET_ACCESS_KEY": "wrong"}, "the store refused the request (SignatureDoesNotMatch"),
    ({"AWS_ACCESS_KEY_ID": "AKIAWRONGWRONGWRONG1"}, "the store refused the request (InvalidAccessKeyId"),
])
def test_wrong_credentials_are_refused_at_once_with_the_reason(s3, tmp_path, change, words):
    out = run(tmp_path / "model", {**s3["env"], **change}, f"s3://{BUCKET}/{PREFIX}", "--retries", "5")
    assert out.returncode == 3, out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith(f"pagoda s3: downloading s3://{BUCKET}/{PREFIX} refused: {words}"), last
    assert "check the credentials in the referenced Secret" in last
    assert "attempt" not in out.stdout  # a refusal is not retried
    assert not (tmp_path / "model" / "config.json").exists()


def test_no_credentials_at_all_is_refused_with_what_to_provide(s3, tmp_path):
    env = {k: v for k, v in s3["env"].items() if k not in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    out = run(tmp_path / "model", env)
    assert out.returncode == 3, out.stderr
    assert "refused: no credentials: reference a Secret holding AWS_ACCESS_KEY_ID" in out.stderr


def test_a_prefix_with_nothing_under_it_is_refused(s3, tmp_path):
    out = run(tmp_path / "model", s3["env"], f"s3://{BUCKET}/org/no-such-model")
    assert out.returncode == 3
    assert f"s3://{BUCKET}/org/no-such-model holds no objects: check the URI" in out.stderr


@pytest.mark.parametrize("uri, flags, words", [
    ("hf://org/model", [], "is not an s3:// URI"),
    ("s3://A_Bucket/x", [], "is not an S3 bucket name"),
    (f"s3://{BUCKET}/{PREFIX}", ["--parallel", "0"], "--parallel must be >= 1"),
])
def test_bad_arguments_exit_2_naming_them(tmp_path, uri, flags, words):
    out = run(tmp_path / "model", {}, uri, *flags)
    assert out.returncode == 2 and words in out.stderr, out.stderr


def test_the_operators_init_container_downloads_where_its_engine_reads(s3, tmp_path):
    """The init container exactly as the operator renders it for an s3:// model and a Secret of
    the store's keys (the cache volume at a directory of this machine): the model lands at the
    engine's --model."""
    from pagoda_operator import render
    from pagoda_operator.validation import check
    from tests.operator.support import load_example, with_spec

    body = with_spec(load_example("llama-3.1-8b.yaml"), model__uri=f"s3://{BUCKET}/{PREFIX}",
                     model__download={"s3SecretRef": {"name": "store"}})
    pod = render.engine_pod_template(body, check(body).spec, render.Images.from_env({}))
    (init,) = pod["spec"]["initContainers"]
    (engine,) = pod["spec"]["containers"]
    secret = {k: s3["env"][k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL")}
    env = {"AWS_EC2_METADATA_DISABLED": "true", "AWS_CONFIG_FILE": "/dev/null", "AWS_SHARED_CREDENTIALS_FILE": "/dev/null"}
    for var in init["env"]:
        ref = var["valueFrom"]["secretKeyRef"]
        assert ref["name"] == "store" and (ref["key"] in secret or ref.get("optional")), var
        if ref["key"] in secret:
            env[var["name"]] = secret[ref["key"]]
    cache = str(tmp_path / "cache")
    local = lambda arg: cache + arg[len(render.MODELS_DIR):] if arg.startswith(render.MODELS_DIR + "/") else arg  # noqa: E731
    assert init["command"][:3] == ["python", "-m", "pagoda_engine.s3_download"]
    base = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    out = subprocess.run([sys.executable, *init["command"][1:3], *map(local, init["command"][3:])], env={**base, **env},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert_model_in(Path(local(engine["args"][engine["args"].index("--model") + 1])))
