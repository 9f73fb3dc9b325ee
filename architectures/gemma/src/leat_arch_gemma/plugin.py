"""Registers the Gemma architectures. Imports nothing heavy."""

from leat import hookimpl


@hookimpl
def register_architectures(register):
    register("gemma", "leat_arch_gemma.gemma:Gemma")
    register("gemma2", "leat_arch_gemma.gemma:Gemma2")
    register("gemma3", "leat_arch_gemma.gemma:Gemma3")
