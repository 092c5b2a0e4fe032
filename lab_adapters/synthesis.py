"""Deprecated: split into ``labrl.lab_adapters.recipes`` (the public recipe rules) and
``labrl.lab_adapters.mock.chemistry`` (the mock lab's hidden chemistry); this path goes in the
next release."""

from labrl._deprecated import moved_module

__getattr__ = moved_module(__name__, "labrl.lab_adapters.mock.chemistry", "labrl.lab_adapters.recipes")
