"""Keys at the edges, with real processes: a `pagoda serve` replica that takes its key from
PAGODA_API_KEY (the internal key), and `pagoda route` in front of it holding that key in
PAGODA_BACKEND_API_KEY and checking its clients' keys from --api-key-file: a directory laid out
as kubelet mounts a Secret, rotated while the router runs."""

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from pagoda_e2e import free_port, start_pagoda, until

INTERNAL_KEY = "internal-key-for-the-engines"
MODEL = "pagoda-tiny"
ENGINE_ARGS = ["--model", MODEL, "--num-kv-pages", "64", "--max-model-len", "64", "--max-num-seqs", "4"]


def mount_secret(directory: Path, files: dict[str, str]) -> None:
    """Write `files` as kubelet updates a mounted Secret: a new hidden timestamped directory, the
    `..data` link swapped onto it in one rename, and each key a link through `..data`."""
    directory.mkdir(exist_ok=True)
    version = directory / f"..{time.monotonic_ns()}"
    version.mkdir()
    for name, text in files.items():
        (version / name).write_text(text)
    tmp_link = directory / "..data_tmp"
    tmp_link.symlink_to(version.name)
    os.replace(tmp_link, directory / "..data")
    for name in files:
        link = directory / name
        if not link.is_symlink():
            link.symlink_to(f"..data/{name}")
    for entry in directory.iterdir():  # keys dropped from the Secret go away
        if entry.is_symlink() and not entry.name.startswith(".") and entry.name not in files:
            entry.unlink()


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("keys")
    engine_port, router_port = free_port(), free_port()
    engine_url, router_url = f"http://127.0.0.1:{engine_port}", f"http://127.0.0.1:{router_port}"
    keys_dir = tmp / "api-keys"
    mount_secret(keys_dir, {"alice": "alice-key-1\n", "team": "team-key-1\n\n  team-key-2  \n"})
    engine = start_pagoda(["serve", "--host", "127.0.0.1", "--port", str(engine_port), *ENGINE_ARGS],
                          tmp / "engine.log", env={"PAGODA_API_KEY": INTERNAL_KEY})
    procs = [engine]
    try:
        engine.wait_http(engine_url + "/health", timeout=300)
        router = start_pagoda(["route", "--host", "127.0.0.1", "--port", str(router_port), "--backends", engine_url,
                               "--health-interval", "0.5", "--api-key-file", str(keys_dir)],
                              tmp / "router.log", env={"PAGODA_BACKEND_API_KEY": INTERNAL_KEY})
        procs.append(router)
        router.wait_http(router_url + "/health", timeout=60)
        yield {"engine": engine_url, "router": router_url, "keys_dir": keys_dir, "tmp": tmp}
    finally:
        for proc in reversed(procs):
            proc.stop()


def client(base: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0, timeout=60)


def complete(base: str, key: str) -> str:
    return client(base, key).completions.create(model=MODEL, prompt="hello", max_tokens=2).choices[0].text


def assert_refused(response: httpx.Response) -> None:
    assert response.status_code == 401, response.text
    assert response.headers["www-authenticate"] == "Bearer"
    assert response.json() == {"error": {"message": "Missing or invalid API key: send `Authorization: Bearer <key>`.",
                                         "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}}


def test_the_engine_takes_its_key_from_pagoda_api_key(stack):
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer alice-key-1"}, {"Authorization": INTERNAL_KEY}):
        assert_refused(httpx.post(stack["engine"] + "/v1/completions", json=body, headers=headers))
    with pytest.raises(openai.AuthenticationError):
        complete(stack["engine"], "alice-key-1")
    assert complete(stack["engine"], INTERNAL_KEY)
    for open_path in ("/health", "/metrics"):
        assert httpx.get(stack["engine"] + open_path).status_code == 200


def test_the_router_refuses_a_missing_or_wrong_client_key(stack):
    base = stack["router"]
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "alice-key-1"},
                    {"Authorization": f"Bearer {INTERNAL_KEY}"}):
        assert_refused(httpx.post(base + "/v1/completions", json=body, headers=headers))
    assert_refused(httpx.get(base + "/v1/models"))
    assert_refused(httpx.get(base + "/router/backends"))
    with pytest.raises(openai.AuthenticationError):
        complete(base, "wrong")
    for open_path in ("/health", "/metrics"):
        assert httpx.get(base + open_path).status_code == 200


def test_a_client_key_reaches_the_engine_through_the_router_holding_the_internal_key(stack):
    base = stack["router"]
    for key in ("alice-key-1", "team-key-1", "team-key-2"):  # every file; blank lines and spaces ignored
        assert complete(base, key)
    with client(base, "team-key-2") as c:
        assert [m.id for m in c.models.list().data] == [MODEL]  # the router's polls carry the key too
        stream = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=3, stream=True)
        assert sum(1 for chunk in stream if chunk.choices and chunk.choices[0].delta.content) >= 1


def test_keys_rotate_without_a_restart(stack):
    base = stack["router"]
    mount_secret(stack["keys_dir"], {"alice": "alice-key-2\n"})  # team removed, alice's key rotated
    until(lambda: httpx.post(base + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1},
                             headers={"Authorization": "Bearer alice-key-2"}).status_code == 200,
          10, "the rotated key to be accepted")
    for old in ("alice-key-1", "team-key-1"):
        with pytest.raises(openai.AuthenticationError):
            complete(base, old)
    assert complete(base, "alice-key-2")


def test_a_key_file_is_re_read_when_rewritten(tmp_path):
    engine_port, router_port = free_port(), free_port()
    keys = tmp_path / "keys.txt"
    keys.write_text("first\n")
    # No replica behind it: an accepted request is held (503 after --queue-timeout), a refused one is 401.
    router = start_pagoda(["route", "--host", "127.0.0.1", "--port", str(router_port),
                           "--backends", f"http://127.0.0.1:{engine_port}", "--queue-timeout", "0",
                           "--api-key-file", str(keys)], tmp_path / "router.log")
    base = f"http://127.0.0.1:{router_port}"
    try:
        router.wait_http(base + "/health", timeout=60)
        status = lambda key: httpx.post(base + "/v1/completions", json={"prompt": "x"},  # noqa: E731
                                        headers={"Authorization": f"Bearer {key}"}).status_code
        assert (status("first"), status("second")) == (503, 401)
        keys.write_text("second\n")
        until(lambda: status("second") == 503, 10, "the rewritten file's key to be accepted")
        assert status("first") == 401
    finally:
        router.stop()


@pytest.mark.parametrize("setup, message", [
    (lambda tmp: None, "--api-key-file {path}: cannot read it"),
    (lambda tmp: (tmp / "keys").write_text("\n  \n"), "--api-key-file {path}: the file holds no key"),
    (lambda tmp: (tmp / "keys").mkdir(), "--api-key-file {path}: no file in the directory holds a key"),
])
def test_the_router_refuses_to_start_with_an_unusable_key_file(tmp_path, setup, message):
    setup(tmp_path)
    path = tmp_path / "keys"
    out = subprocess.run([sys.executable, "-m", "pagoda_engine.router.app", "--backends", "http://127.0.0.1:1",
                          "--api-key-file", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    assert out.stderr.startswith("pagoda route: error: " + message.format(path=path)), out.stderr


@pytest.mark.parametrize("flags, env, message", [
    (["--backend-api-key", " "], {}, "--backend-api-key is empty"),
    ([], {"PAGODA_BACKEND_API_KEY": ""}, "PAGODA_BACKEND_API_KEY is set but empty"),
])
def test_the_router_refuses_an_empty_backend_key(flags, env, message):
    out = subprocess.run([sys.executable, "-m", "pagoda_engine.router.app", "--backends", "http://127.0.0.1:1", *flags],
                         capture_output=True, text=True, timeout=60, env={**os.environ, **env})
    assert out.returncode == 2 and out.stderr.startswith("pagoda route: error: " + message), out.stderr
