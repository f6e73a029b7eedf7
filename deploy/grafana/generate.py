"""Generate deploy/grafana/vgpu-sharing.json with the Grafana Foundation SDK (dashboards as code).

    python deploy/grafana/generate.py            # rewrite the committed JSON
    python deploy/grafana/generate.py --check    # exit 1 if the committed JSON is out of date

Edit this file, not the JSON: tests/deploy/test_dashboard.py checks that the committed JSON is this
script's output, and tests/deploy/test_prometheus.py sends every panel query to a real Prometheus.
Metrics: docs/metrics.md; recording rules: deploy/prometheus/rules.yaml.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from grafana_foundation_sdk.builders import dashboard as gd
from grafana_foundation_sdk.builders import prometheus, stat, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import dashboard as dm

OUT = Path(__file__).resolve().parent / "vgpu-sharing.json"
DS = dm.DataSourceRef(type_val="prometheus", uid="${datasource}")
NODE = 'Hostname=~"$Hostname"'
SLICE = f'{NODE}, namespace=~"$namespace", claim=~"$claim"'
RATE = "$__rate_interval"


def _query(expr: str, legend: str, ref: str) -> prometheus.Dataquery:
    return prometheus.Dataquery().expr(expr).legend_format(legend).ref_id(ref).datasource(DS)


def _series(
    title: str, unit: str, targets: list[tuple[str, str]], description: str, width: int = 12
) -> timeseries.Panel:
    p = (
        timeseries.Panel()
        .title(title)
        .description(description)
        .unit(unit)
        .datasource(DS)
        .height(8)
        .span(width)
        .min(0)
    )
    for i, (expr, legend) in enumerate(targets):
        p = p.with_target(_query(expr, legend, chr(ord("A") + i)))
    return p


def _stat(title: str, unit: str, expr: str, legend: str, description: str) -> stat.Panel:
    return (
        stat.Panel()
        .title(title)
        .description(description)
        .unit(unit)
        .datasource(DS)
        .height(4)
        .span(6)
        .with_target(_query(expr, legend, "A"))
    )


def _variable(name: str, label: str, query: str) -> gd.QueryVariable:
    return (
        gd.QueryVariable(name)
        .label(label)
        .datasource(DS)
        .query(query)
        .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .multi(True)
        .include_all(True)
        .all_value(".*")
        .sort(dm.VariableSort.ALPHABETICAL_ASC)
    )


GPU = "{{Hostname}} GPU {{gpu}}"
SL = "{{namespace}}/{{claim}} GPU {{gpu}}"

# (title, unit, PromQL, legend, description)
STATS: tuple[tuple[str, str, str, str, str], ...] = (
    ("GPUs healthy", "none", f"sum(vgpu_device_healthy{{{NODE}}})", "healthy",
     "GPUs whose last NVML reading succeeded and is fresh."),
    ("Slices", "none", f"sum(vgpu_device_slices{{{NODE}}})", "slices",
     "Slices (claim x GPU) on the selected nodes."),
    ("Memory promised", "percentunit",
     f"sum(vgpu_device_memory_allocated_bytes{{{NODE}}}) / "
     f"sum(vgpu_device_memory_total_bytes{{{NODE}}})",
     "allocated", "Sum of slice memory quotas over the GPUs' memory."),
    ("Violations (1h)", "none", f"sum(increase(vgpu_slice_quota_violations_total{{{NODE}}}[1h]))",
     "violations", "Watchdog findings: slices over quota by NVML's count, GPU processes of no slice."),
)  # fmt: skip

# (title, unit, [(PromQL, legend)], description)
Panels = tuple[tuple[str, str, list[tuple[str, str]], str], ...]
GPU_PANELS: Panels = (
    ("GPU memory: total, promised to slices, used", "bytes", [
        (f"vgpu_device_memory_total_bytes{{{NODE}}}", f"{GPU} total"),
        (f"vgpu_device_memory_allocated_bytes{{{NODE}}}", f"{GPU} quotas"),
        (f"vgpu_device_memory_used_bytes{{{NODE}}}", f"{GPU} used (NVML)"),
    ], "Device memory NVML reports, the sum of the slices' quotas, and what is in use."),
    ("GPU compute: caps promised vs utilisation", "percentunit", [
        (f"vgpu_device_cores_allocated_ratio{{{NODE}}}", f"{GPU} caps"),
        (f"vgpu_device_utilization_ratio{{{NODE}}}", f"{GPU} busy (NVML)"),
    ], "Sum of the slices' compute caps, and the device's NVML utilisation."),
)  # fmt: skip
SLICE_PANELS: Panels = (
    ("Slice memory: quota vs used", "bytes", [
        (f"vgpu_slice_memory_limit_bytes{{{SLICE}}}", f"{SL} quota"),
        (f"vgpu_slice_memory_used_bytes{{{SLICE}}}", f"{SL} used"),
        (f"vgpu_slice_memory_peak_bytes{{{SLICE}}}", f"{SL} peak"),
    ], "Each slice's memory quota, what its processes hold (as the shim charged it), and its peak."),
    ("Slice memory by container", "bytes", [
        (f"vgpu_container_memory_used_bytes{{{SLICE}}}",
         "{{namespace}}/{{claim}} {{pod}} {{container}} ({{container_id}}) GPU {{gpu}}"),
    ], "What each container of a claim holds on the GPU (NVML's count, contexts included), by the "
       "container's cgroup: a claim shared by several containers split up. pod and container = "
       "the names the kubelet gives (empty where unknown); container_id = the runtime's "
       "container ID (12 digits), empty for processes in no container."),
    ("Slice memory use over quota", "percentunit", [
        (f"vgpu_slice:memory_used_over_limit:ratio{{{SLICE}}}", SL),
    ], "Recording rule vgpu_slice:memory_used_over_limit:ratio; alert VgpuSliceNearMemoryQuota at 90 %."),
    ("Slice compute: cap vs achieved", "percentunit", [
        (f"vgpu_slice_compute_limit_ratio{{{SLICE}}}", f"{SL} cap " + "({{compute_policy}})"),
        (f"vgpu_slice_compute_used_ratio{{{SLICE}}}", f"{SL} achieved"),
    ], "Compute cap (its compute policy in brackets: hard, elastic = may use idle SMs beyond it, "
       "off = no cap, shown as 0; alert VgpuSliceUncapped) and the share of device time charged "
       "to the slice over the last scrape interval."),
    ("Throttling: fraction of time held back", "percentunit", [
        (f"clamp_max(rate(vgpu_slice_throttled_seconds_total{{{SLICE}}}[{RATE}]), 1)", SL),
    ], "Time the slice's launches waited for budget, per second. Alert VgpuSliceThrottled above 50 % for 10m."),
    ("Launches charged", "ops", [
        (f"rate(vgpu_slice_launches_total{{{SLICE}}}[{RATE}])", SL),
    ], "Kernel launches per second admitted by the compute gate (capped slices)."),
    ("Allocation denials", "short", [
        (f"rate(vgpu_slice_alloc_denied_total{{{SLICE}}}[{RATE}])", f"{SL} denials/s"),
        (f"rate(vgpu_slice_alloc_denied_bytes_total{{{SLICE}}}[{RATE}])", f"{SL} bytes/s"),
    ], "Allocations refused because the slice's quota was reached, and the bytes they asked for."),
    ("Quota violations (watchdog)", "short", [
        (f"increase(vgpu_slice_quota_violations_total{{{NODE}}}[{RATE}])",
         "{{namespace}}/{{claim}} on {{Hostname}} GPU {{gpu}}"),
    ], "Slices over quota + margin by NVML's count; empty namespace/claim: a GPU process of no slice."),
    ("Processes per slice", "none", [
        (f"vgpu_slice_processes{{{SLICE}}}", SL),
    ], "Live processes of the slice the shim is loaded into."),
    ("Processes without the shim (watchdog)", "none", [
        (f"vgpu_slice_processes_without_shim{{{SLICE}}}", SL),
    ], "GPU processes of the slice that run without libvgpu: no limit applies. Alert VgpuShimNotLoaded."),
)  # fmt: skip
EXPORTER_PANELS: Panels = (
    ("Scrape health", "none", [('up{job=~"vgpu.*"}', "{{instance}} up")],
     "1 while Prometheus scrapes the exporter. Alert VgpuExporterDown after 5m at 0."),
    ("Scrape duration", "s",
     [('vgpu_exporter_scrape_duration_seconds{job=~"vgpu.*"}', "{{instance}}")],
     "Time the exporter took to read the node for a scrape."),
)  # fmt: skip


def build() -> gd.Dashboard:
    d = (
        gd.Dashboard("vgpu-sharing: GPUs and slices")
        .uid("vgpu-sharing")
        .description(
            "Shared GPUs (vgpu-sharing): per-GPU allocation and use, per-slice quota vs "
            "use, compute cap vs achieved share, throttling, denials, watchdog violations."
        )
        .tags(["vgpu-sharing", "gpu", "dra"])
        .editable()
        .refresh("30s")
        .time("now-1h", "now")
        .timezone("browser")
        .with_variable(gd.DatasourceVariable("datasource").label("Data source").type("prometheus"))
        .with_variable(_variable("Hostname", "Node", "label_values(vgpu_device_healthy, Hostname)"))
        .with_variable(
            _variable(
                "namespace",
                "Namespace",
                f"label_values(vgpu_slice_memory_limit_bytes{{{NODE}}}, namespace)",
            )
        )
        .with_variable(
            _variable(
                "claim",
                "Claim",
                f'label_values(vgpu_slice_memory_limit_bytes{{{NODE}, namespace=~"$namespace"}}, '
                "claim)",
            )
        )
    )
    d = d.with_row(gd.Row("GPUs"))
    for title, unit, expr, legend, doc in STATS:
        d = d.with_panel(_stat(title, unit, expr, legend, doc))
    for row, panels in (
        ("GPUs", GPU_PANELS),
        ("Slices", SLICE_PANELS),
        ("Exporter", EXPORTER_PANELS),
    ):
        if row != "GPUs":
            d = d.with_row(gd.Row(row))
        for title, unit, targets, doc in panels:
            d = d.with_panel(_series(title, unit, targets, doc))
    return d


def render() -> str:
    return json.dumps(build().build(), cls=JSONEncoder, indent=2, sort_keys=True) + "\n"


def main(argv: list[str]) -> int:
    text = render()
    if argv[1:] == ["--check"]:
        if OUT.read_text() != text:
            print(f"{OUT} is out of date: run python deploy/grafana/generate.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
