"""Layer 5, advice: the versioned plan, its exporters, float-preserving rewrites, and verify."""
