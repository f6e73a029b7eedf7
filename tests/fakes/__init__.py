"""Test stand-ins for the components no machine here has (a Kubernetes API server)."""
