"""Registers the Gemma 4 architecture. Imports nothing heavy."""

from leat import hookimpl


@hookimpl
def register_architectures(register):
    register("gemma4", "leat_arch_gemma4.gemma4:Gemma4")
