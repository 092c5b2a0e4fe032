"""Test doubles shipped in the wheel: a fake SGLang server speaking the real HTTP protocol (docs/sglang.md)."""
