"""Model definitions (single-device code) and the registry of named architectures."""
