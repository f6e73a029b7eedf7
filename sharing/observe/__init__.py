"""What reads the node: slices, NVML, processes, containers, the watchdog and the exporter's
library half. The plugin may use it; it never imports the commands (sharing.cli)."""
