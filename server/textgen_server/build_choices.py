"""The models `textgen-server build-test-model` builds, named without importing torch: the CLI refuses a request
for another before it imports the builders (torch and transformers' model classes, seconds of CPU).

Text archs and sizes are builder.py's, vision-language ones vlm_builder.py's (its `VLM_SIZES` holds each size's
dimensions under these names).
"""

from __future__ import annotations

TEXT_ARCHS = ("llama", "gpt2", "mistral", "qwen2")
TEXT_SIZES = ("tiny", "small", "1b")
VLM_ARCHS = ("llava_next", "idefics3", "qwen2_vl", "qwen2_5_vl")
VLM_SIZE_NAMES = ("tiny", "small")


def check_choice(kind: str, value: str, choices: tuple[str, ...]) -> None:
    """Raise ValueError, one line naming the choices, when `value` is not one of them."""
    if value not in choices:
        raise ValueError(f"unknown {kind} {value!r}; expected one of {', '.join(choices)}")


def check_build(arch: str, size: str) -> None:
    """What `build-test-model --arch ARCH --size SIZE` checks before it imports a builder."""
    check_choice("arch", arch, TEXT_ARCHS + VLM_ARCHS)
    check_choice("size", size, VLM_SIZE_NAMES if arch in VLM_ARCHS else TEXT_SIZES)
