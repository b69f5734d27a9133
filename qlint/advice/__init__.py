"""The advice layer: the versioned plan, its exporters, float-preserving rewrites, and verify."""
