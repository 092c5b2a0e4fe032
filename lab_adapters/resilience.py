"""Deprecated: moved to ``labrl.resilience`` (shared by the lab, judge and SGLang clients); this path
goes in the next release."""

from labrl._deprecated import moved_module

__getattr__ = moved_module(__name__, "labrl.resilience")
