"""Registers the llama architecture. Imports nothing heavy."""

from leat import hookimpl


@hookimpl
def register_architectures(register):
    register("llama", "leat_arch_llama.llama:Llama")
