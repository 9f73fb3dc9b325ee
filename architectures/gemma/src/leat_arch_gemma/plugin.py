"""Registers the Gemma architectures and their chat formats. Imports nothing heavy."""

from leat import hookimpl


@hookimpl
def register_architectures(register):
    register("gemma", "leat_arch_gemma.gemma:Gemma")
    register("gemma2", "leat_arch_gemma.gemma:Gemma2")
    register("gemma3", "leat_arch_gemma.gemma:Gemma3")


@hookimpl
def register_chat_formats(register):
    register("gemma", "leat_arch_gemma.formats:GemmaParser")
    register("functiongemma", "leat_arch_gemma.formats:FunctionGemmaParser")
