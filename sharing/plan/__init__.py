"""`vgpu plan`: how many workloads of each size fit on a set of ResourceSlices, and where.

Modules, one job each:
  quantity   Kubernetes quantities as exact Decimals, and their canonical text
  model      the domain model (devices, device classes, claim specs, workloads)
  yamlread   YAML/JSON documents from libyaml's events (PyYAML's meaning, faster)
  loader     reading and validating the YAML/JSON inputs (errors name the file and field path)
  cel_eval   DeviceClass / request selectors through a real CEL library (celpy) with the
             Kubernetes extension functions (quantity, semver) and a per-device result cache
  capacity   consumable capacity: request policies, rounding, refusals
  allocator  one claim on one node, with the DRA allocator's search and constraints
  planner    workloads over nodes in first-fit order, and why the rest did not fit
  report     the text table and the JSON document
  command    the `vgpu plan` subcommand
"""
