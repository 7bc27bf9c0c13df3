"""The launcher's failures, named like TGI's `LauncherError` variants.

`main` prints `Error: <Kind>` or `Error: <Kind>("<detail>")` for them and exits 1, as TGI's binary does
when its `main` returns an error.
"""
from __future__ import annotations


class LauncherError(Exception):
    """Base class: `kind` is TGI's variant name, the message (if any) its payload."""

    kind = "LauncherError"

    def render(self) -> str:
        detail = str(self)
        return f'Error: {self.kind}("{detail}")' if detail else f"Error: {self.kind}"


class ArgumentValidation(LauncherError):
    kind = "ArgumentValidation"


class NotEnoughCUDADevices(LauncherError):
    kind = "NotEnoughCUDADevices"


class DownloadError(LauncherError):
    kind = "DownloadError"


class ShardCannotStart(LauncherError):
    kind = "ShardCannotStart"


class ShardFailed(LauncherError):
    kind = "ShardFailed"


class WebserverFailed(LauncherError):
    kind = "WebserverFailed"


class WebserverCannotStart(LauncherError):
    kind = "WebserverCannotStart"


class PortInUse(LauncherError):
    """Not in TGI (its router fails later, after the model loaded): checked before anything starts."""

    kind = "PortInUse"
