"""Hookimpls only, and nothing heavy imported: what is registered is a lazy "module:Class" reference."""

from leat import hookimpl


@hookimpl
def register_backends(register):
    # Automatic choice takes the usable backend with the highest priority; this one is slower than the CPU
    # backend (priority 0), so it runs only when named: `--backend example`. A real device backend asks for more.
    register("example", "leat_backend_example.backend:ExampleBackend", priority=-10)
