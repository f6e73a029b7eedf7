"""The `vgpu` commands (docs/architecture.md): used by nothing outside this package."""
