"""`vgpu selftest`: the conformance run an operator executes on a node before trusting it.

environment.py (driver, GPU, glibc, NVML, the shim in a runtime and a driver-API program),
memory.py (every allocation route against a slice's quota), compute.py (achieved share at
caps, measured by the driver), cost.py (the shim's start-up and per-call cost), report.py (checks,
thresholds, the text and JSON report), probe.py (running the C probe in a slice),
command.py (the subcommand).
"""
