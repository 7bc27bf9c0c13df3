"""download-weights against a stand-in hub on 127.0.0.1 (HF_ENDPOINT), run as a real process each time."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

SHA = "0123456789abcdef0123456789abcdef01234567"


@dataclass
class Repo:
    files: dict[str, bytes]
    sha: str = SHA
    unserved: frozenset[str] = frozenset()  # listed by the API but 404 on download (a broken mirror)


@dataclass
class StandInHub:
    """The slice of the HF HTTP API huggingface_hub uses for model info and file downloads."""

    repos: dict[str, Repo]
    requests: list[str] = field(default_factory=list)

    def answer(self, parts: list[str]) -> tuple[bytes, dict[str, str]] | str:
        """(body, headers) of a 200 answer to the path `parts`, or the X-Error-Code of a 404."""
        if parts[0] == "api" and parts[1] == "models":  # /api/models/{org}/{name}[/revision/{rev}]
            return self._model_info(parts)
        if len(parts) >= 5 and parts[2] == "resolve":  # /{org}/{name}/resolve/{rev}/{file}
            return self._file(parts)
        return "RepoNotFound"

    def _model_info(self, parts: list[str]) -> tuple[bytes, dict[str, str]] | str:
        repo = self.repos.get("/".join(parts[2:4]))
        if repo is None:
            return "RepoNotFound"
        if len(parts) > 5 and parts[5] not in ("main", repo.sha):
            return "RevisionNotFound"
        info = {
            "id": "/".join(parts[2:4]),
            "sha": repo.sha,
            "siblings": [{"rfilename": name} for name in sorted(repo.files)],
        }
        return json.dumps(info).encode(), {"Content-Type": "application/json"}

    def _file(self, parts: list[str]) -> tuple[bytes, dict[str, str]] | str:
        repo = self.repos.get("/".join(parts[:2]))
        if repo is None:
            return "RepoNotFound"
        if parts[3] not in ("main", repo.sha):
            return "RevisionNotFound"
        name = "/".join(parts[4:])
        body = None if name in repo.unserved else repo.files.get(name)
        if body is None:
            return "EntryNotFound"
        etag = '"' + hashlib.sha256(body).hexdigest() + '"'
        return body, {"X-Repo-Commit": repo.sha, "ETag": etag, "Content-Type": "application/octet-stream"}

    def handler(self) -> type[BaseHTTPRequestHandler]:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:  # keep pytest output clean
                pass

            def _error(self, code: str) -> None:
                self.send_response(404)
                self.send_header("X-Error-Code", code)
                self.send_header("Content-Type", "application/json")
                body = json.dumps({"error": code}).encode()
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command == "GET":
                    self.wfile.write(body)

            def _send(self, body: bytes, headers: dict[str, str]) -> None:
                self.send_response(200)
                for key, value in headers.items():
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command == "GET":
                    self.wfile.write(body)

            def _route(self) -> None:
                path = self.path.split("?")[0]
                hub.requests.append(f"{self.command} {path}")
                answer = hub.answer(path.strip("/").split("/"))
                if isinstance(answer, str):
                    self._error(answer)
                else:
                    self._send(*answer)

            do_GET = do_HEAD = _route

        return Handler


def model_files(model_dir: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in model_dir.iterdir() if p.is_file() and not p.name.startswith(".")}


@pytest.fixture(scope="module")
def hub(
    tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path, tiny_gpt2: Path
) -> Iterator[tuple[StandInHub, str, Path, Path]]:
    root = tmp_path_factory.mktemp("hub")
    llama, gpt2 = tiny_llama, tiny_gpt2
    sf_files = model_files(llama) | {
        "training_args.bin": b"not weights",
        "README.md": b"# tiny",
        "onnx/model.safetensors": b"nested, not fetched",
    }
    bin_files = {n: b for n, b in model_files(gpt2).items() if n != "model.safetensors"}
    state = load_file(str(gpt2 / "model.safetensors"))
    # transformers saves a tied model with one name; a real .bin checkpoint holds both, sharing storage.
    state["lm_head.weight"] = state["transformer.wte.weight"]
    bin_path = root / "pytorch_model.bin"
    torch.save(state, bin_path)
    bin_files["pytorch_model.bin"] = bin_path.read_bytes()
    stand_in = StandInHub(
        {
            "acme/tiny-llama": Repo(sf_files),
            "acme/tiny-gpt2-bin": Repo(bin_files),
            "acme/broken": Repo(sf_files, unserved=frozenset({"model.safetensors"})),
        }
    )
    server = ThreadingHTTPServer(("127.0.0.1", 0), stand_in.handler())
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield stand_in, f"http://127.0.0.1:{server.server_address[1]}", llama, gpt2
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def download(model_id: str, endpoint: str, cache: Path, *extra: str, **env: str) -> subprocess.CompletedProcess:
    child_env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    child_env.update(HF_ENDPOINT=endpoint, HUGGINGFACE_HUB_CACHE=str(cache), HF_HUB_DISABLE_PROGRESS_BARS="1", **env)
    return subprocess.run(
        [sys.executable, "-m", "textgen_server.cli", "download-weights", model_id, *extra],
        env=child_env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def snapshot_of(cache: Path, model_id: str) -> Path:
    return cache / f"models--{model_id.replace('/', '--')}" / "snapshots" / SHA


def error_lines(done: subprocess.CompletedProcess) -> list[str]:
    """The CLI's error log lines (its logs go to stdout; a traceback would land on stderr)."""
    return [line for line in (done.stdout + done.stderr).splitlines() if "ERROR" in line or "Traceback" in line]


def test_safetensors_download_then_offline(
    hub: tuple[StandInHub, str, Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stand_in, endpoint, llama, _ = hub
    stand_in.requests.clear()
    done = download("acme/tiny-llama", endpoint, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    snapshot = snapshot_of(tmp_path, "acme/tiny-llama")
    assert sorted(p.name for p in snapshot.iterdir()) == sorted(model_files(llama))
    for name in model_files(llama):
        assert (snapshot / name).read_bytes() == (llama / name).read_bytes(), name
    fetched = [r for r in stand_in.requests if r.startswith("GET /acme")]
    assert not any("training_args" in r or "README" in r or "onnx" in r for r in fetched)

    # Warm cache + HF_HUB_OFFLINE: same directory, and the hub is not asked anything.
    stand_in.requests.clear()
    offline = download("acme/tiny-llama", endpoint, tmp_path, HF_HUB_OFFLINE="1")
    assert offline.returncode == 0, offline.stdout + offline.stderr
    assert "Files are already present on the host. Skipping download." in offline.stdout
    assert stand_in.requests == []

    from textgen_server import hub as hub_module

    monkeypatch.setenv("HUGGINGFACE_HUB_CACHE", str(tmp_path))
    assert hub_module.resolve_model_dir("acme/tiny-llama") == snapshot
    assert hub_module.resolve_model_dir("acme/tiny-llama", SHA) == snapshot
    with pytest.raises(hub_module.ModelNotFoundError, match="Please run `textgen-server download-weights"):
        hub_module.resolve_model_dir("acme/other")


def test_offline_cold_cache_fails_clearly(hub: tuple[StandInHub, str, Path, Path], tmp_path: Path) -> None:
    stand_in, endpoint, _, _ = hub
    stand_in.requests.clear()
    done = download("acme/tiny-llama", endpoint, tmp_path, HF_HUB_OFFLINE="true")
    assert done.returncode == 1
    [line] = error_lines(done)
    assert "Model acme/tiny-llama is not in the hub cache" in line and "HF_HUB_OFFLINE is set" in line
    assert stand_in.requests == []


def test_bin_is_converted_to_safetensors(hub: tuple[StandInHub, str, Path, Path], tmp_path: Path) -> None:
    _, endpoint, _, gpt2 = hub
    done = download("acme/tiny-gpt2-bin", endpoint, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    snapshot = snapshot_of(tmp_path, "acme/tiny-gpt2-bin")
    converted = load_file(str(snapshot / "model.safetensors"))
    original = load_file(str(gpt2 / "model.safetensors"))
    # The alias goes (the class re-ties lm_head from the embedding); every real tensor is kept bit-exact.
    assert set(converted) == set(original)
    assert all(torch.equal(converted[k], original[k]) for k in original)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(snapshot)
    assert torch.equal(model.lm_head.weight, original["transformer.wte.weight"])

    no_convert = download("acme/tiny-gpt2-bin", endpoint, tmp_path / "other", "--no-auto-convert")
    assert no_convert.returncode == 1
    [line] = error_lines(no_convert)
    assert "Model acme/tiny-gpt2-bin has only .bin weights and --auto-convert is off" in line


def test_missing_repo_and_revision(hub: tuple[StandInHub, str, Path, Path], tmp_path: Path) -> None:
    _, endpoint, _, _ = hub
    missing = download("acme/nope", endpoint, tmp_path)
    assert missing.returncode == 1
    [line] = error_lines(missing)
    assert line.endswith(f"Model acme/nope is neither a local directory nor a model on the hub ({endpoint})")
    bad_rev = download("acme/tiny-llama", endpoint, tmp_path, "--revision", "v9")
    assert bad_rev.returncode == 1
    [line] = error_lines(bad_rev)
    assert line.endswith("Revision v9 of model acme/tiny-llama not found on the hub")
    broken = download("acme/broken", endpoint, tmp_path)
    assert broken.returncode == 1
    [line] = error_lines(broken)
    assert "Download of model.safetensors of model acme/broken failed" in line
    not_an_id = download(str(tmp_path / "no-such-dir"), endpoint, tmp_path)
    assert not_an_id.returncode == 1
    [line] = error_lines(not_an_id)
    assert "is neither a local directory nor a valid model id on the hub" in line


def test_local_directory(
    hub: tuple[StandInHub, str, Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from textgen_server.hub import ModelNotFoundError, download_weights, resolve_model_dir

    stand_in, _, llama, _ = hub
    assert download_weights(str(llama)) == llama
    assert resolve_model_dir(str(llama)) == llama
    # WEIGHTS_CACHE_OVERRIDE: a hub id is served from that directory, and the hub is never asked.
    stand_in.requests.clear()
    monkeypatch.setenv("WEIGHTS_CACHE_OVERRIDE", str(llama))
    assert download_weights("acme/tiny-llama") == llama
    assert resolve_model_dir("acme/anything") == llama
    assert stand_in.requests == []
    monkeypatch.delenv("WEIGHTS_CACHE_OVERRIDE")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelNotFoundError, match="has no .safetensors weights"):
        download_weights(str(tmp_path))
    (tmp_path / "config.json").unlink()
    with pytest.raises(ModelNotFoundError, match="has no config.json"):
        download_weights(str(tmp_path))
