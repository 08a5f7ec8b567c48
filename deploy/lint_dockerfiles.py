"""Lint the intent of deploy/docker/*.Dockerfile (no Docker engine needed).

Checks what the images must be, not Dockerfile style:
  * every service (gateway, draft, verify) has a Dockerfile;
  * the final stage runs as a non-root USER, has a HEALTHCHECK, an exec-form ENTRYPOINT/CMD
    (so SIGTERM reaches specd and it drains), binds 0.0.0.0 via SPECD_HOST, EXPOSEs its gRPC port
    and the metrics port, and serves the right service;
  * base images are pinned to a tag (never implicit or :latest);
  * the gateway image installs no torch, transformers, CUDA or NVIDIA packages, does not start from
    a CUDA/PyTorch base, and installs specd itself with --no-deps;
  * the model images start from a CUDA base and take the model from SPECD_MODEL;
  * every requirements file a Dockerfile installs pins each package with ==, to the same version
    as the repository's requirements.txt.

Usage: python deploy/lint_dockerfiles.py [DOCKER_DIR]   (exit status 1 on any finding)
"""

from __future__ import annotations

import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PORTS = {"gateway": 50051, "draft": 50052, "verify": 50053}
METRICS_PORT = 9464
FORBIDDEN_IN_GATEWAY = re.compile(r"\b(torch\w*|transformers|accelerate|nvidia[\w./-]*|cuda[\w.-]*|pytorch|triton|vllm)\b", re.I)
CUDA_BASE = re.compile(r"^(nvidia/cuda|pytorch/pytorch|nvcr\.io/nvidia/)", re.I)


@dataclass
class Instruction:
    keyword: str
    args: str
    line: int


@dataclass
class Dockerfile:
    path: Path
    args: dict = field(default_factory=dict)  # ARG defaults declared before the first FROM
    stages: list = field(default_factory=list)  # each a list of Instruction, starting with FROM

    @property
    def final(self) -> list:
        return self.stages[-1]


def parse(path: Path) -> Dockerfile:
    """Instructions with line continuations joined and comments dropped; split into stages."""
    parsed = Dockerfile(path)
    logical, start = "", 0
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        stripped = raw.strip()
        if not logical and (not stripped or stripped.startswith("#")):
            continue
        if logical and stripped.startswith("#"):
            continue
        if not logical:
            start = number
        if stripped.endswith("\\"):
            logical += stripped[:-1] + " "
            continue
        logical += stripped
        keyword, _, rest = logical.partition(" ")
        instruction = Instruction(keyword.upper(), rest.strip(), start)
        logical = ""
        if instruction.keyword == "FROM":
            parsed.stages.append([instruction])
        elif parsed.stages:
            parsed.stages[-1].append(instruction)
        elif instruction.keyword == "ARG":
            name, _, default = instruction.args.partition("=")
            parsed.args[name.strip()] = default.strip().strip('"')
    return parsed


def env_of(stage: list) -> dict:
    """ENV key=value pairs set in a stage (the later wins)."""
    env = {}
    for instruction in stage:
        if instruction.keyword == "ENV":
            for token in shlex.split(instruction.args):
                if "=" in token:
                    key, _, value = token.partition("=")
                    env[key] = value
    return env


def base_image(dockerfile: Dockerfile, instruction: Instruction) -> str:
    image = instruction.args.split()[0]
    match = re.fullmatch(r"\$\{?(\w+)\}?", image)
    return dockerfile.args.get(match.group(1), image) if match else image


def shown(path: Path) -> str:
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def pip_installs(command: str) -> list:
    """The `pip install ...` pieces of a RUN command (split at &&, ||, ;)."""
    return [part.strip() for part in re.split(r"&&|\|\||;", command) if "pip install" in part]


def read_requirements(path: Path) -> dict:
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line or line.startswith("-"):
            continue
        name, sep, version = line.partition("==")
        pins[re.sub(r"[-_.]+", "-", name.strip().lower())] = version.strip() if sep else None
    return pins


def project_packages() -> list:
    """The top-level source folders pyproject's packages.find includes from the repository root."""
    text = (REPO / "pyproject.toml").read_text()
    include = re.search(r"include\s*=\s*\[([^\]]*)\]", text.split("[tool.setuptools.packages.find]", 1)[1]).group(1)
    names = [name.strip().strip('"').rstrip("*") for name in include.split(",") if name.strip()]
    return sorted(name for name in names if (REPO / name).is_dir())


def lint(service: str, path: Path, repo_pins: dict) -> list:
    problems = []

    def problem(message: str, line: int = 0) -> None:
        problems.append(f"{shown(path)}{':' + str(line) if line else ''}: {message}")

    dockerfile = parse(path)
    if not dockerfile.stages:
        problem("no FROM")
        return problems
    final = dockerfile.final

    # Base images: pinned to a tag or digest.
    stage_names = {s[0].args.split()[-1].lower() for s in dockerfile.stages if " as " in s[0].args.lower()}
    for stage in dockerfile.stages:
        image = base_image(dockerfile, stage[0])
        if image.lower() in stage_names:
            continue
        if "@sha256:" not in image and (":" not in image.rsplit("/", 1)[-1] or image.endswith(":latest")):
            problem(f"base image {image!r} is not pinned to a tag", stage[0].line)

    # Runtime user: the last USER of the final stage is not root.
    users = [i for i in final if i.keyword == "USER"]
    if not users:
        problem("final stage has no USER (runs as root)")
    elif users[-1].args.split(":")[0] in {"root", "0"}:
        problem(f"final USER is {users[-1].args!r}", users[-1].line)

    # Health: a HEALTHCHECK that is not NONE.
    checks = [i for i in final if i.keyword == "HEALTHCHECK"]
    if not checks or checks[-1].args.upper().startswith("NONE"):
        problem("final stage has no HEALTHCHECK")

    # Entrypoint in exec form (JSON), serving this service.
    entry = [i for i in final if i.keyword in {"ENTRYPOINT", "CMD"}]
    if not entry:
        problem("no ENTRYPOINT or CMD")
    else:
        if not entry[-1].args.startswith("["):
            problem("ENTRYPOINT/CMD in shell form: SIGTERM would not reach specd", entry[-1].line)
        if f'"serve", "{service}"' not in " ".join(i.args for i in entry):
            problem(f'ENTRYPOINT does not run `specd serve {service}`', entry[-1].line)

    # Network: bind all interfaces in the container, expose the gRPC and metrics ports.
    env = env_of(final)
    if env.get("SPECD_HOST") != "0.0.0.0":
        problem("SPECD_HOST is not 0.0.0.0 in the final stage (the server would bind loopback only)")
    if env.get("SPECD_PORT") != str(PORTS[service]):
        problem(f"SPECD_PORT is not {PORTS[service]}")
    exposed = {int(p.split("/")[0]) for i in final if i.keyword == "EXPOSE" for p in i.args.split()}
    for port in (PORTS[service], METRICS_PORT):
        if port not in exposed:
            problem(f"port {port} is not EXPOSEd")

    # What gets installed.
    installs = [i for stage in dockerfile.stages for i in stage if i.keyword == "RUN" and "pip install" in i.args]
    requirement_files = []
    for stage in dockerfile.stages:
        for i in stage:
            if i.keyword == "COPY":
                for source in i.args.split()[:-1]:
                    if source.endswith(".txt") and "requirements" in source:
                        requirement_files.append(REPO / source)
    for requirements in requirement_files:
        if not requirements.exists():
            problem(f"copies {shown(requirements)}, which does not exist")
            continue
        for name, version in read_requirements(requirements).items():
            where = shown(requirements)
            if version is None:
                problem(f"{where}: {name} is not pinned with ==")
            elif name in repo_pins and repo_pins[name] not in (None, version):
                problem(f"{where}: {name}=={version} but requirements.txt pins {repo_pins[name]}")
            if service == "gateway" and FORBIDDEN_IN_GATEWAY.search(name):
                problem(f"{where}: the gateway image must not install {name}")
    # Every package specd installs (pyproject's packages.find) is copied in before `pip install .`:
    # a missing one installs fine and fails only when the CLI imports it.
    copied = {source.strip("./") for stage in dockerfile.stages for i in stage if i.keyword == "COPY" for source in i.args.split()[:-1]}
    for package in project_packages():
        if package not in copied:
            problem(f"the package {package}/ is never copied in (pip install . would install specd without it)")
    project_installs = [i for i in installs if re.search(r"pip install[^&|;]*\s(\.|-e \.)(\s|$)", i.args)]
    if not project_installs:
        problem("specd itself is never installed (pip install --no-deps .)")
    for i in project_installs:
        if "--no-deps" not in i.args:
            problem("specd is installed without --no-deps: its dependency resolution could pull in anything", i.line)

    if service == "gateway":
        for stage in dockerfile.stages:
            image = base_image(dockerfile, stage[0])
            if CUDA_BASE.search(image) or FORBIDDEN_IN_GATEWAY.search(image):
                problem(f"the gateway image starts from {image!r} (CUDA/torch base)", stage[0].line)
        for i in installs:
            for command in pip_installs(i.args):
                found = FORBIDDEN_IN_GATEWAY.search(command)
                if found:
                    problem(f"the gateway image installs {found.group(0)!r}", i.line)
    else:
        image = base_image(dockerfile, final[0])
        if not CUDA_BASE.search(image):
            problem(f"model image {service} does not start from a CUDA base (got {image!r})", final[0].line)
        if not any(re.search(r"\btorch\b", c) for i in installs for c in pip_installs(i.args)):
            problem("model image installs no torch")
        if "SPECD_MODEL" not in env:
            problem("model image does not declare SPECD_MODEL (the model path or hub id)")
        if service == "draft" and env.get("SPECD_DRAFTER") not in {"model", "ngram", "feature"}:
            problem("draft image does not set SPECD_DRAFTER to model, ngram or feature")
    return problems


def main(argv: list) -> int:
    docker_dir = Path(argv[1]).resolve() if len(argv) > 1 else REPO / "deploy" / "docker"
    repo_pins = read_requirements(REPO / "requirements.txt")
    problems = []
    for service in PORTS:
        path = docker_dir / f"{service}.Dockerfile"
        if not path.exists():
            problems.append(f"{shown(path)}: missing (one Dockerfile per service)")
            continue
        problems += lint(service, path, repo_pins)
    for line in problems:
        print(f"ERROR {line}")
    if not problems:
        print(f"OK {len(PORTS)} Dockerfiles in {shown(docker_dir)}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
