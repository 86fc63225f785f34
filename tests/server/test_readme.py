"""The README works as written. Its facts hold against the repository (what `make serve` binds,
the test command CI runs, the Kubernetes version the chart asks for, the files it links, the
example it deploys), and its tour's examples run against a real `pagoda serve` with no --model
(only the port differs, so tests can run in parallel): the default model, SmolLM2-135M-Instruct,
answers the curl example sensibly, the official openai client streams, and a request with tools
is refused until a tool parser is configured, as the README says. docs/serving.md's structured
outputs example runs the same way."""

import argparse
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import openai
import pytest
import yaml
from openai import OpenAI

from pagoda_engine.cli import build_parser
from tests.engine.test_default_model import needs_smollm2
from tests.server.conftest import launch

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
SERVING = ROOT / "docs" / "serving.md"


def _blocks(path: Path) -> list[str]:
    return re.findall(r"```(?:bash)?\n(.*?)```", path.read_text(), flags=re.S)


def _make_recipe(target: str) -> str:
    makefile = (ROOT / "Makefile").read_text()
    return makefile[makefile.index(f"\n{target}:"):].split("\n\n")[0]


# --- facts -------------------------------------------------------------------------------------


def test_readme_stays_short_and_its_two_commands_are_make_serve_and_make_test():
    text = README.read_text()
    assert len(text.splitlines()) <= 150
    first_block = _blocks(README)[0]
    assert [line.split("#")[0].strip() for line in first_block.strip().splitlines()] == ["make serve", "make test"]
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^make test$", ci, flags=re.M), "CI runs the README's test command"


def test_make_serve_binds_the_address_the_readme_gives():
    """README: `make serve` listens on 127.0.0.1:8000 and ARGS="--host 0.0.0.0 ..." exposes it. The
    command is the one make runs (`make -n`, which runs nothing), parsed by `pagoda serve`'s parser."""
    [subparsers] = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    serve = subparsers.choices["serve"]

    def served_address(*make_args: str) -> tuple[str, int]:
        out = subprocess.run(["make", "-n", "serve", *make_args], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout
        [serve_line] = [line for line in out.splitlines() if re.match(r"\S*pagoda serve", line)]
        args = serve.parse_args(shlex.split(serve_line.split("pagoda serve", 1)[1]))
        return args.host, args.port

    assert served_address() == ("127.0.0.1", 8000)
    assert "make serve` listens on `127.0.0.1:8000`" in README.read_text()
    assert served_address("ARGS=--host 0.0.0.0 --api-key k") == ("0.0.0.0", 8000)
    assert served_address("ARGS=--host=0.0.0.0 --port 9000") == ("0.0.0.0", 9000)


def test_readme_kubernetes_version_is_the_charts():
    chart = yaml.safe_load((ROOT / "charts" / "pagoda" / "Chart.yaml").read_text())
    minimum = re.match(r">=\s*(\d+\.\d+)", chart["kubeVersion"])[1]
    text = README.read_text()
    stated = set(re.findall(r"kubectl ≥ (\d+\.\d+)", text))
    assert stated == {minimum}, (stated, chart["kubeVersion"])


def test_readme_links_and_paths_exist():
    text = README.read_text()
    links = re.findall(r"\]\(([^)#]+)\)", text)
    assert {"docs/architecture.md", "docs/serving.md", "docs/operator.md", "docs/benchmarks.md"} <= set(links)
    paths = re.findall(r"`((?:examples|charts|kustomize|engine|operator|e2e|tests|images|crds|docs)/[\w./-]*)`", text)
    paths += re.findall(r"(examples/[\w.-]+\.yaml)", text) + re.findall(r"-k ([\w./-]+)", text)
    for path in {*links, *paths}:
        assert (ROOT / path).exists(), path


def test_readme_deploys_an_example_the_operator_renders():
    [apply] = re.findall(r"kubectl apply -f (\S+)", README.read_text())
    out = subprocess.run([sys.executable, "-m", "pagoda_operator.cli", "render", "-f", str(ROOT / apply)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    kinds = {doc["kind"] for doc in yaml.safe_load_all(out.stdout) if doc}
    assert {"Deployment", "Service"} <= kinds
    for name in ("operator", "engine", "engine-cpu"):
        assert f"pagoda/{name}:dev" in README.read_text()
        assert (ROOT / "images" / f"{name}.Dockerfile").is_file()
    assert "pagoda/engine-cpu:dev" in _make_recipe("images")


def test_readme_names_every_tool_parser_the_engine_has():
    from pagoda_engine.api.tool_parsers import TOOL_PARSERS

    line = re.search(r"the parsers: (.*?)\)", README.read_text(), flags=re.S)[1]
    assert set(re.findall(r"`(\w+)`", line)) == set(TOOL_PARSERS)


# --- the tour, against a real server -----------------------------------------------------------


@pytest.fixture(scope="module")
def default_server(tmp_path_factory):
    # No --model: the default model. A small KV pool keeps start-up fast.
    srv = launch(tmp_path_factory.mktemp("serve-default"), "--num-kv-pages", "256", "--max-model-len", "1024")
    yield srv
    srv.proc.stop()


def _run(block: str, server) -> str:
    script = block.replace("127.0.0.1:8000", f"127.0.0.1:{server.port}")
    script = script.replace(".venv/bin/python", sys.executable)
    out = subprocess.run(["bash", "-euo", "pipefail", "-c", script], capture_output=True, text=True, timeout=120,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr
    return out.stdout


@needs_smollm2
def test_readme_curl_example_gets_a_sensible_english_answer(default_server):
    [curl] = [b for b in _blocks(README) if b.startswith("curl")]
    reply = json.loads(_run(curl, default_server))
    assert reply["model"] == "SmolLM2-135M-Instruct"
    assert "Paris" in reply["choices"][0]["message"]["content"], reply


@needs_smollm2
def test_readme_openai_client_example(default_server):
    [python] = [b for b in _blocks(README) if "from openai import OpenAI" in b]
    output = _run(python, default_server)
    assert re.search(r"\[\d+ tokens\]\s*$", output), output
    assert re.search(r"[A-Za-z]{3,}", output), output  # words, not a random model's token soup


@needs_smollm2
def test_the_openai_client_gets_paris_for_the_capital_of_france(default_server):
    client = OpenAI(base_url=default_server.base_url, api_key="unused")
    assert [m.id for m in client.models.list()] == ["SmolLM2-135M-Instruct"]
    reply = client.chat.completions.create(model="SmolLM2-135M-Instruct", temperature=0, max_tokens=24,
                                           messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "stop"  # ends its turn (<|im_end|>) on its own


@needs_smollm2
def test_the_default_model_refuses_tools_until_a_parser_is_configured(default_server):
    """README: served without a tool parser, a request with tools is a 400 naming the two flags."""
    client = OpenAI(base_url=default_server.base_url, api_key="unused", max_retries=0)
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}}
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="SmolLM2-135M-Instruct", max_tokens=8, tools=[tool],
                                       messages=[{"role": "user", "content": "Weather in Paris?"}])
    assert "--enable-auto-tool-choice" in str(refused.value) and "--tool-call-parser" in str(refused.value)
    assert "--enable-auto-tool-choice --tool-call-parser" in README.read_text()


@needs_smollm2
def test_serving_md_structured_outputs_example(default_server):
    [python] = [b for b in _blocks(SERVING) if "structured_outputs" in b and "from openai import OpenAI" in b]
    first, second = _run(python, default_server).splitlines()
    person = json.loads(first)
    assert set(person) == {"name", "age"} and 0 <= person["age"] <= 120 and len(person["name"]) <= 8
    assert second in ("yes", "no")
