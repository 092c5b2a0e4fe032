"""Deprecated: moved to ``labrl.lab_adapters.mock.simlab`` (this path goes in the next release)."""

from labrl._deprecated import moved_module

__getattr__ = moved_module(__name__, "labrl.lab_adapters.mock.simlab")
