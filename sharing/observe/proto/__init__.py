"""Generated gRPC code of the kubelet APIs the exporter calls (generate.py)."""
