"""The launcher's failures, named like TGI's `LauncherError` variants.

`main` prints `Error: <Kind>` or `Error: <Kind>("<detail>")` for them and exits 1, as TGI's binary does
when its `main` returns an error.
"""

from __future__ import annotations


class LauncherError(Exception):
    """Base class: the subclass name is TGI's variant name, the message (if any) its payload."""

    def render(self) -> str:
        kind, detail = type(self).__name__, str(self)
        return f'Error: {kind}("{detail}")' if detail else f"Error: {kind}"


class ArgumentValidation(LauncherError): ...


class NotEnoughCUDADevices(LauncherError): ...


class DownloadError(LauncherError): ...


class ShardCannotStart(LauncherError): ...


class ShardFailed(LauncherError): ...


class WebserverFailed(LauncherError): ...


class WebserverCannotStart(LauncherError): ...


class PortInUse(LauncherError):
    """Not in TGI (its router fails later, after the model loaded): checked before anything starts."""
