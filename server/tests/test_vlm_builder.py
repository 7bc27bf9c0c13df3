"""The tiny vision-language models of textgen_server.vlm_builder: what transformers loads and generates from, with
the model's own processor, offline (the oracle issue 38's serving will be checked against)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from testing.models import build_vlm
from testing.vlm_oracle import VlmOracle, image_bytes
from textgen_server import cli
from textgen_server.build_choices import VLM_ARCHS, VLM_SIZE_NAMES
from textgen_server.vlm_builder import VLM_SIZES, build_test_vlm


@pytest.mark.parametrize("arch", VLM_ARCHS)
def test_transformers_generates_from_it_and_the_image_decides_the_tokens(arch: str) -> None:
    oracle = VlmOracle(build_vlm(arch))
    prompt = ("Look: ", " what is it?")

    def greedy(image: bytes) -> tuple[int, list[int]]:
        """The prompt's length with the image's tokens expanded, and the greedy tokens after it."""
        length = oracle.inputs(prompt[0], image, prompt[1])["input_ids"].shape[1]
        return length, oracle.greedy(prompt[0], image, prompt[1], 10)

    length, tokens = greedy(image_bytes(0, 48, 80))
    assert len(tokens) == 10
    assert greedy(image_bytes(0, 48, 80)) == (length, tokens)  # the same image: the same tokens
    assert greedy(image_bytes(1, 48, 80))[1] != tokens  # another image of that size: other tokens
    assert greedy(image_bytes(2, 90, 40))[0] != length  # another shape: another count of image tokens


@pytest.mark.parametrize("arch", VLM_ARCHS)
def test_rebuild_is_identical_and_reuse_is_free(arch: str, tmp_path: Path) -> None:
    cached = build_vlm(arch)
    rebuilt = build_test_vlm(tmp_path / arch, arch)
    names = sorted(path.name for path in cached.iterdir() if path.name != ".textgen-build.json")
    assert names == sorted(path.name for path in rebuilt.iterdir() if path.name != ".textgen-build.json")
    assert {"model.safetensors", "tokenizer.json", "config.json"} < set(names)
    for name in names:
        assert hashlib.sha256((cached / name).read_bytes()).digest() == (
            hashlib.sha256((rebuilt / name).read_bytes()).digest()
        ), name
    stamp = (rebuilt / ".textgen-build.json").stat().st_mtime_ns
    assert build_test_vlm(tmp_path / arch, arch) == rebuilt
    assert (rebuilt / ".textgen-build.json").stat().st_mtime_ns == stamp


def test_cli_builds_a_vlm_and_refuses_an_unknown_size(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`textgen-server build-test-model DIR --arch idefics3`, run in this process (its subprocess start is
    test_builder.py's)."""
    for argv, code in (
        ([str(tmp_path / "m"), "--arch", "idefics3"], 0),
        ([str(tmp_path / "n"), "--arch", "llava_next", "--size", "1b"], 2),
    ):
        with pytest.raises(SystemExit) as exited:
            cli.main(["build-test-model", *argv])
        assert exited.value.code == code
    assert (tmp_path / "m" / "processor_config.json").is_file()
    assert "unknown size '1b'; expected one of tiny, small" in capsys.readouterr().out
    assert not (tmp_path / "n").exists()


def test_the_cli_checks_the_builders_own_sizes(tmp_path: Path) -> None:
    """The CLI checks names from build_choices before it imports the builder: they must be the builder's."""
    assert tuple(VLM_SIZES) == VLM_SIZE_NAMES
    with pytest.raises(ValueError, match="unknown vision-language size '1b'; expected one of tiny, small"):
        build_test_vlm(tmp_path / "x", "llava_next", size="1b")
