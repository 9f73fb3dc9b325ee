"""Registers the llama architecture and its chat formats. Imports nothing heavy."""

from leat import hookimpl


@hookimpl
def register_architectures(register):
    register("llama", "leat_arch_llama.llama:Llama")


@hookimpl
def register_chat_formats(register):
    register("llama3", "leat_arch_llama.formats:Llama3Parser")
    register("mistral", "leat_arch_llama.formats:MistralParser")
