"""Builds textgen's container image from the Dockerfile (`make image`), with docker or podman, on a base and a
package index this machine can reach.

- Engine: docker where its daemon answers, else podman (daemonless; on machines with only a docker client).
- Base: the Dockerfile's default (`python:3.11-slim`) where it is present or can be pulled; where no registry
  answers, a Debian base made here with debootstrap from Debian's package mirror and imported as
  `localhost/debian-base:bookworm` (made once, kept by the engine).
- Packages: with podman, the build sees this machine's pip configuration (`pip config list`: its wheel folders,
  file indexes, constraints and CA bundle, mounted read-only), so torch comes from whatever index the machine
  has, the local CPU wheel included, and a registry behind a TLS-intercepting proxy is trusted as it is here.
- Layers are cached: the dependencies' layer depends on pyproject.toml only, so a build after a source change
  reinstalls textgen alone (Dockerfile).
"""

from __future__ import annotations

import argparse
import os
import resource
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_TAG = "localhost/textgen:latest"
DEFAULT_BASE = "python:3.11-slim"
LOCAL_BASE = "localhost/debian-base:bookworm"
DEBIAN_MIRROR = "http://deb.debian.org/debian"
# The pip settings carried into the build: paths among them are mounted at the same place.
PIP_KEYS = ("index-url", "extra-index-url", "find-links", "cert", "constraint", "trusted-host", "timeout")
HOST_CA = "/host-ca.crt"  # not the image's own bundle path, which its ca-certificates package may rewrite


def engine() -> str:
    """docker where a daemon answers `docker info`, else podman; raises SystemExit when neither can build."""
    if shutil.which("docker") and _quiet(["docker", "info"]):
        return "docker"
    if shutil.which("podman"):
        return "podman"
    raise SystemExit("no container engine: install podman (apt-get install podman runc) or start a docker daemon")


def rlimit_flags(tool: str, image: str) -> list[str]:
    """`--ulimit` flags under which `image` starts here; none where the engine's defaults work.

    podman asks the kernel for its default limits (nofile 1048576), which a VM whose limits are lower refuses
    ("error setting rlimit ... operation not permitted"); then the flags ask for this process's own limits, with
    nproc halved until a container starts (seen on a Zen 3 VM: podman's conmon holds nproc at 32768, below the
    shell's 96364). docker's daemon sets limits itself: no flags."""
    if tool != "podman" or _starts(tool, image, []):
        return []
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)
    nproc = resource.getrlimit(resource.RLIMIT_NPROC)[1]
    while nproc >= 1024:
        flags = ["--ulimit", f"nofile={nofile[0]}:{nofile[1]}", "--ulimit", f"nproc={nproc}:{nproc}"]
        if _starts(tool, image, flags):
            return flags
        nproc //= 2
    raise SystemExit(
        f"no container starts here under the limits of this shell: `{tool} run --rm --entrypoint true {image}`"
    )


def _starts(tool: str, image: str, flags: list[str]) -> bool:
    return _quiet([tool, "run", "--rm", "--network", "host", *flags, "--entrypoint", "true", image])


def has_image(tool: str, ref: str) -> bool:
    return _quiet([tool, "image", "inspect", ref])


def pick_base(tool: str, wanted: str) -> str:
    """`wanted` when present or pullable; else (the default base only) the local Debian base, made if missing."""
    if has_image(tool, wanted) or _quiet([tool, "pull", wanted], timeout=600):
        return wanted
    if wanted != DEFAULT_BASE:
        raise SystemExit(f"base image {wanted} is neither present nor pullable")
    print(f"{wanted} cannot be pulled here (no registry): using {LOCAL_BASE}", file=sys.stderr)
    if not has_image(tool, LOCAL_BASE):
        make_debian_base(tool)
    return LOCAL_BASE


def make_debian_base(tool: str, mirror: str = DEBIAN_MIRROR) -> None:
    """A minimal Debian bookworm root filesystem from the package mirror, imported as LOCAL_BASE."""
    if not shutil.which("debootstrap"):
        raise SystemExit("no registry and no debootstrap to make a local base: apt-get install debootstrap")
    with tempfile.TemporaryDirectory(prefix="textgen-rootfs-") as rootfs:
        start = time.monotonic()
        subprocess.run(["debootstrap", "--variant=minbase", "bookworm", rootfs, mirror], check=True)
        tar = subprocess.Popen(["tar", "-C", rootfs, "-c", "."], stdout=subprocess.PIPE)
        subprocess.run([tool, "import", "-", LOCAL_BASE], stdin=tar.stdout, check=True)
        if tar.wait() != 0:
            raise SystemExit("tar of the debootstrap root failed")
        print(f"made {LOCAL_BASE} in {time.monotonic() - start:.0f} s", file=sys.stderr)


@dataclass
class PipMirror:
    """This machine's pip configuration as the build sees it: a pip.conf and the read-only mounts it names."""

    settings: dict[str, str] = field(default_factory=dict)
    mounts: dict[str, str] = field(default_factory=dict)  # host path -> path in the build ("": the same)

    @classmethod
    def from_host(cls) -> PipMirror:
        out = subprocess.run(
            [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=True
        ).stdout
        mirror = cls()
        for line in out.splitlines():
            key, _, value = line.partition("=")
            name = key.rpartition(".")[2]
            if name in PIP_KEYS:  # later lines (env:) override earlier ones (files), as pip reads them
                mirror.settings[name] = value.strip().strip("'\"")
        for name, value in list(mirror.settings.items()):
            mirror.settings[name] = " ".join(mirror._carry(name, item) for item in value.split())
        return mirror

    def _carry(self, name: str, item: str) -> str:
        """A path (or file:// URL) mounted read-only into the build; anything else unchanged."""
        path = item.removeprefix("file://")
        if not os.path.isabs(path) or not os.path.exists(path):
            return item
        if name == "cert":
            self.mounts[path] = HOST_CA
            return HOST_CA
        # a file index (…/simple) links to its files beside it, in the folder above
        self.mounts.setdefault(os.path.dirname(path) if item.startswith("file://") else path, "")
        return item

    def conf(self) -> str:
        return "[global]\n" + "".join(f"{name} = {value}\n" for name, value in self.settings.items())


def build_command(
    tool: str, tag: str, base: str, torch_index: str | None, pip: PipMirror | None, conf_path: str | None
) -> list[str]:
    cmd = [tool, "build", "-t", tag, "--build-arg", f"BASE={base}"]
    if torch_index:
        cmd += ["--build-arg", f"TORCH_INDEX={torch_index}"]
    if pip is not None and conf_path is not None:
        # podman mounts volumes into RUN steps (docker has no build volumes: it uses the Dockerfile's indexes)
        cmd += ["--network", "host", *rlimit_flags(tool, base), "-v", f"{conf_path}:/etc/pip.conf:ro"]
        for host, inside in pip.mounts.items():
            cmd += ["-v", f"{host}:{inside or host}:ro"]
        if not torch_index and "index-url" not in pip.settings:
            # torch==2.13.0 from the mounted wheel folders or PyPI, not from torch's own index, which a machine
            # whose pip has a local wheel usually cannot reach
            cmd += ["--build-arg", "TORCH_INDEX=https://pypi.org/simple"]
    return [*cmd, "-f", str(ROOT / "Dockerfile"), str(ROOT)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tag", default=os.environ.get("IMAGE", DEFAULT_TAG))
    parser.add_argument("--base", default=os.environ.get("IMAGE_BASE", DEFAULT_BASE))
    # the CUDA variant: --base nvidia/cuda:12.8.1-runtime-ubuntu24.04 --torch-index .../whl/cu128 (README)
    parser.add_argument("--torch-index", default=os.environ.get("TORCH_INDEX"), help="torch's wheel index")
    args = parser.parse_args()
    tool = engine()
    base = pick_base(tool, args.base)
    pip = PipMirror.from_host() if tool == "podman" else None
    with tempfile.NamedTemporaryFile("w", prefix="textgen-pip-", suffix=".conf") as conf:
        if pip is not None:
            conf.write(pip.conf())
            conf.flush()
            os.chmod(conf.name, 0o644)
        cmd = build_command(tool, args.tag, base, args.torch_index, pip, conf.name if pip is not None else None)
        print(shlex.join(cmd), file=sys.stderr)
        start = time.monotonic()
        subprocess.run(cmd, check=True)
    size = subprocess.run(
        [tool, "image", "inspect", "--format", "{{.Size}}", args.tag], capture_output=True, text=True, check=True
    ).stdout.strip()
    print(f"built {args.tag} in {time.monotonic() - start:.0f} s, {int(size) / 1e9:.2f} GB", file=sys.stderr)


def _quiet(cmd: list[str], timeout: float = 60) -> bool:
    try:
        done = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


if __name__ == "__main__":
    main()
