"""Errors a user sees. Each carries one line that says what is wrong and what to do next.

The CLI prints ``str(error)`` and exits non-zero; it never shows a traceback for these.
"""

from __future__ import annotations


class LeatError(Exception):
    """Base class for every error leat reports to a user."""

    exit_code = 1


class ModelFileError(LeatError):
    """A GGUF file is missing, malformed, truncated, or lacks a metadata key or tensor."""


class UnknownArchitecture(LeatError):
    """No installed plugin serves the file's ``general.architecture``."""


class UnsupportedQuantType(LeatError):
    """A tensor's quantization type is not handled by the chosen backend."""


class BackendUnavailable(LeatError):
    """The requested backend cannot run on this machine (its probe said why)."""


class PluginError(LeatError):
    """A plugin failed to import, or two plugins claim the same name."""


class PullError(LeatError):
    """A model could not be fetched or verified."""


class TemplateError(LeatError):
    """A chat template failed to render."""
