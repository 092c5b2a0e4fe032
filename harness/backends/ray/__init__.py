"""labrl on Ray (``backend=ray``): actors that place and connect the in-process components; docs/ray.md."""
