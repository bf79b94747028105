"""deploy/Dockerfile, checked statically (no Docker engine here): its build arguments, that every
file it copies exists and is not excluded by .dockerignore, that it installs every package folder
with the CI constraints, runs as the chart's non-root user, warms the DeepSpeed JIT cache as that
user, and that its entrypoint and health check are commands the userdp CLI accepts."""

from __future__ import annotations

import fnmatch
import json
import re
import shlex
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from userdp.cli import build_parser

REPO_ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO_ROOT / "deploy" / "Dockerfile"
VALUES = REPO_ROOT / "deploy" / "helm" / "userdp" / "values.yaml"


@dataclass(frozen=True)
class Instruction:
    keyword: str
    value: str
    stage: int  # index of the FROM this instruction belongs to (-1 = before the first FROM)

    def exec_form(self) -> list[str] | None:
        """The JSON array of an exec-form instruction, or None for the shell form."""
        text = self.value.strip()
        if text.startswith("["):
            parsed = json.loads(text)
            assert all(isinstance(part, str) for part in parsed), self
            return parsed
        return None


def parse_dockerfile(text: str) -> list[Instruction]:
    """Instructions of a Dockerfile: comments dropped, backslash continuations joined."""
    instructions: list[Instruction] = []
    stage = -1
    pending = ""
    for raw in text.splitlines():
        stripped = raw.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if pending and stripped.startswith("#"):
            continue  # a comment line inside a continued instruction
        if stripped.endswith("\\"):
            pending += stripped[:-1].rstrip() + " "
            continue
        line = pending + stripped
        pending = ""
        keyword, _, value = line.partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            stage += 1
        instructions.append(Instruction(keyword, value.strip(), stage))
    assert not pending, "Dockerfile ends inside a continued line"
    return instructions


@pytest.fixture(scope="module")
def instructions() -> list[Instruction]:
    return parse_dockerfile(DOCKERFILE.read_text())


@pytest.fixture(scope="module")
def final_stage(instructions) -> list[Instruction]:
    last = max(i.stage for i in instructions)
    return [i for i in instructions if i.stage == last]


def _args(instructions: list[Instruction]) -> dict[str, str]:
    found = {}
    for instruction in instructions:
        if instruction.keyword == "ARG":
            name, _, default = instruction.value.partition("=")
            found[name] = default.strip('"')
    return found


def test_parser_handles_continuations_and_comments() -> None:
    parsed = parse_dockerfile(
        'ARG A=1\nFROM x\n# c\nRUN a \\\n    # inner\n    && b\nCMD ["p", "q"]\n'
    )
    stages = [(i.keyword, i.stage) for i in parsed]
    assert stages == [("ARG", -1), ("FROM", 0), ("RUN", 0), ("CMD", 0)]
    assert parsed[2].value == "a && b"
    assert parsed[3].exec_form() == ["p", "q"]


def test_build_args_select_cuda_or_cpu_and_match_the_ci_pins(instructions) -> None:
    args = _args(instructions)
    for name in (
        "BASE_IMAGE",
        "TORCH_INDEX_URL",
        "TORCH_VERSION",
        "PYTHON_VERSION",
        "DS_ACCELERATOR",
        "TORCH_CUDA_ARCH_LIST",
        "DS_WARM_OPS",
        "USERDP_EXTRAS",
        "USERDP_UID",
        "PYTHON_SOURCE",
        "UV_VERSION",
        "TORCH_FIND_LINKS",
    ):
        assert name in args, f"build arg {name} missing"
    assert args["PYTHON_SOURCE"] == "uv" and args["TORCH_FIND_LINKS"] == ""
    assert "cuda" in args["BASE_IMAGE"] and "devel" in args["BASE_IMAGE"]  # nvcc for DS ops
    assert args["TORCH_INDEX_URL"].startswith("https://download.pytorch.org/whl/cu")
    assert args["DS_ACCELERATOR"] == "cuda"
    # The CPU variant documented in the header is a real set of build args.
    header = DOCKERFILE.read_text()
    assert "--build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in header
    assert "--build-arg DS_ACCELERATOR=cpu" in header
    constraints = (REPO_ROOT / "constraints.txt").read_text()
    (torch_pin,) = re.findall(r"^torch==(\S+)$", constraints, flags=re.M)
    assert args["TORCH_VERSION"] == torch_pin
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    assert project["requires-python"] == f">={args['PYTHON_VERSION']}"
    froms = [i.value for i in instructions if i.keyword == "FROM"]
    assert froms == ["${BASE_IMAGE}"], "one stage, from the base image only (no other registry)"


def test_the_registry_free_build_script_passes_only_declared_build_args(instructions) -> None:
    """scripts/image.sh builds without a registry: every --build-arg it passes is an ARG here."""
    script = (REPO_ROOT / "scripts" / "image.sh").read_text()
    passed = set(re.findall(r"--build-arg (\w+)=", script))
    assert {"BASE_IMAGE", "PYTHON_SOURCE", "TORCH_FIND_LINKS", "TORCH_VERSION"} <= passed
    assert passed <= set(_args(instructions)), passed - set(_args(instructions))


def _dockerignore_patterns() -> list[str]:
    lines = (REPO_ROOT / ".dockerignore").read_text().splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.startswith("#")]


def _ignored(relative: str, patterns: list[str]) -> bool:
    for pattern in patterns:
        bare = pattern.removeprefix("**/")
        if fnmatch.fnmatch(relative, pattern) or relative == pattern:
            return True
        if relative.startswith(pattern.rstrip("/") + "/"):
            return True
        if pattern.startswith("**/") and any(
            fnmatch.fnmatch(part, bare) for part in relative.split("/")
        ):
            return True
    return False


def test_every_copied_path_exists_in_the_context_and_is_not_ignored(final_stage) -> None:
    patterns = _dockerignore_patterns()
    for ignored in (".venv", ".git", "runs"):
        assert ignored in patterns, f".dockerignore should exclude {ignored}"
    copies = [i for i in final_stage if i.keyword == "COPY"]
    assert copies
    for copy in copies:
        parts = shlex.split(copy.value)
        if any(p.startswith("--from=") for p in parts):
            continue
        sources = [p for p in parts[:-1] if not p.startswith("--")]
        for source in sources:
            path = REPO_ROOT / source
            assert path.exists(), f"COPY {source}: not in the build context (repo root)"
            assert not _ignored(source.rstrip("/"), patterns), f"COPY {source} is .dockerignored"


def test_the_image_installs_every_package_folder_with_the_constraints(final_stage) -> None:
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    folders = set(project["tool"]["setuptools"]["package-dir"].values())
    copied = set()
    for copy in (i for i in final_stage if i.keyword == "COPY"):
        parts = shlex.split(copy.value)
        copied |= {p.rstrip("/") for p in parts[:-1] if not p.startswith("--")}
    assert folders <= copied, f"not copied: {folders - copied}"
    assert {"pyproject.toml", "constraints.txt", project["project"]["readme"]} <= copied
    runs = " ".join(i.value for i in final_stage if i.keyword == "RUN")
    assert re.search(r"pip install .*-c constraints\.txt \"\.\[\$\{USERDP_EXTRAS\}\]\"", runs)
    assert "torch==${TORCH_VERSION}" in runs and "--index-url ${TORCH_INDEX_URL}" in runs


def test_runs_as_the_charts_non_root_user(instructions, final_stage) -> None:
    users = [i.value for i in final_stage if i.keyword == "USER"]
    assert users, "no USER: the image would run as root"
    uid = _args(instructions)["USERDP_UID"]
    assert users[-1] == "${USERDP_UID}:${USERDP_UID}"
    assert int(uid) >= 1000
    chart = yaml.safe_load(VALUES.read_text())["securityContext"]
    assert chart == {"runAsUser": int(uid), "runAsGroup": int(uid)}
    runs = [i.value for i in final_stage if i.keyword == "RUN"]
    assert any("useradd --uid ${USERDP_UID}" in run for run in runs)


def test_deepspeed_ops_are_warmed_into_the_jit_cache_as_the_runtime_user(final_stage) -> None:
    env = " ".join(i.value for i in final_stage if i.keyword == "ENV")
    assert "TORCH_EXTENSIONS_DIR=/opt/userdp/torch_extensions" in env
    keywords = [i.keyword for i in final_stage]
    user_at = keywords.index("USER")
    warm = [
        n
        for n, i in enumerate(final_stage)
        if i.keyword == "RUN" and "python -m userdp.clients.deepspeed_ops" in i.value
    ]
    assert warm and warm[0] > user_at, "op build must run after USER (cache owned by that user)"
    assert "DS_ACCELERATOR=${DS_ACCELERATOR}" in final_stage[warm[0]].value
    installed = [
        n for n, i in enumerate(final_stage) if i.keyword == "RUN" and "uv pip install" in i.value
    ]
    assert installed and installed[0] < warm[0], "the op is built by the installed package"
    chown = [i.value for i in final_stage[:user_at] if i.keyword == "RUN" and "chown" in i.value]
    assert any("${TORCH_EXTENSIONS_DIR}" in c for c in chown)


def test_entrypoint_is_userdp_and_the_healthcheck_is_a_real_command(final_stage) -> None:
    (entrypoint,) = [i for i in final_stage if i.keyword == "ENTRYPOINT"]
    assert entrypoint.exec_form() == ["userdp"]
    (cmd,) = [i for i in final_stage if i.keyword == "CMD"]
    assert cmd.exec_form() == ["--help"]
    (healthcheck,) = [i for i in final_stage if i.keyword == "HEALTHCHECK"]
    options, _, command = healthcheck.value.partition("CMD ")
    assert "--interval=" in options and "--timeout=" in options
    argv = json.loads(command)
    assert argv[0] == "userdp"
    parsed = build_parser().parse_args(argv[1:])
    assert parsed.command == "deploy" and parsed.deploy_command == "probe"
