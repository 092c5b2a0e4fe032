"""The SGLang sampler: HTTP client of SGLang servers, their pool, wire format, launcher and weight transports."""
