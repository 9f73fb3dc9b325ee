"""Registers the Qwen architectures and their chat formats. Imports nothing heavy."""

from leat import hookimpl


@hookimpl
def register_architectures(register):
    register("qwen3", "leat_arch_qwen3.qwen:Qwen3")
    register("qwen3moe", "leat_arch_qwen3.qwen:Qwen3Moe")
    register("qwen2", "leat_arch_qwen3.qwen:Qwen2")


@hookimpl
def register_chat_formats(register):
    register("hermes", "leat_arch_qwen3.formats:HermesParser")
