"""The vgpu-sharing DRA driver: the kubelet plugin `vgpu-kubelet-plugin` (see docs/driver.md)."""
