"""`vgpu run` flags of the compute cap (docs/compute.md): an EnvContributor (sharing/cli/run_flags.py)
for sharing/cli/run.py.

--compute PERCENT      cap of every device (CUDA_DEVICE_SM_LIMIT), 0-100; 0 or 100 = no cap
--compute-<i> PERCENT  cap of device <i> as the command sees it (CUDA_DEVICE_SM_LIMIT_<i>)
--policy hard|elastic|off   VGPU_COMPUTE_POLICY
--priority N           VGPU_PRIORITY (-100..100, lower = higher priority; elastic idle time)
"""

from __future__ import annotations

import argparse

from sharing.cli.run_flags import RunConfigError, add_per_device, per_device_env
from sharing.limitsfile import POLICIES
from sharing.percent import PercentError, parse_permille


class ComputeContributor:
    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        add_per_device(
            parser,
            "compute",
            "PERCENT",
            "compute (SM time) cap of every device in percent, 0-100, e.g. 30 (0 or 100: no cap; "
            "above 100 is refused)",
            "compute cap of device <i> as the command sees it",
        )
        parser.add_argument(
            "--policy",
            choices=POLICIES,
            help="hard (default: the cap holds even on an idle device), elastic (use idle time, "
            "give it back within 100 ms), off",
        )
        parser.add_argument(
            "--priority",
            metavar="N",
            help="priority for idle time in elastic mode, -100..100, lower is higher (default 1)",
        )

    def env(self, args: argparse.Namespace) -> dict[str, str]:
        env = per_device_env(args, "compute", "CUDA_DEVICE_SM_LIMIT", _percent)
        if args.policy:
            env["VGPU_COMPUTE_POLICY"] = args.policy
        if args.priority is not None:
            try:
                p = int(args.priority)
            except ValueError:
                p = 1000
            if not -100 <= p <= 100:
                raise RunConfigError(
                    f"--priority: {args.priority!r} is not an integer from -100 to 100"
                )
            env["VGPU_PRIORITY"] = str(p)
        return env


def _percent(flag: str, text: str) -> str:
    try:
        parse_permille(text, flag)
    except PercentError as e:
        raise RunConfigError(str(e)) from e
    return text.strip()


COMPUTE = ComputeContributor()
