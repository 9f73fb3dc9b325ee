"""Registers the gpt-oss architecture and its chat formats. Imports nothing heavy."""

from leat import hookimpl


@hookimpl
def register_architectures(register):
    register("gpt-oss", "leat_arch_gpt_oss.gpt_oss:GptOss")


@hookimpl
def register_chat_formats(register):
    register("harmony", "leat_arch_gpt_oss.formats:HarmonyParser")
