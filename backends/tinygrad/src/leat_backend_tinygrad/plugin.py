"""Registers the tinygrad backend. Imports nothing heavy (tinygrad loads only when the backend is used)."""

from leat import hookimpl


@hookimpl
def register_backends(register):
    # Below the numpy backend: without TinyJit a decode step still costs seconds on tinygrad's CPU
    # device, so it runs only when asked for (--backend tinygrad).
    register("tinygrad", "leat_backend_tinygrad.backend:TinygradBackend", priority=-10)
