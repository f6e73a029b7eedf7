"""Random SIGKILL of the plugin during batches of prepares and unprepares, then restart.

Each round starts the plugin (a real process, real sockets), retries the call a kill cut short
(as the kubelet does), then sends a random series of NodePrepareResources /
NodeUnprepareResources batches while a timer SIGKILLs the process at a random moment. After
every restart, before the retry:

- every checkpoint entry is PrepareCompleted, and the checkpoint, the CDI dir, the claim dirs
  (with their limits file and shared dir) and the demand files name the same claims;
- every claim the kubelet was last told is prepared is prepared; every claim it was last told
  is unprepared is not; only the claims of the interrupted call may be either;
and after the retry the prepared set is exactly what the kubelet was last told.

CI runs a fixed seed and a bounded number of rounds (test below, well under a minute). A longer
soak, reproducible from its seed:

    .venv/bin/python -m tests.driver.test_prepare_soak --seed 7 --rounds 500

prints one line per round and, on a failure, the seed and round to rerun.
"""

from __future__ import annotations

import argparse
import random
import shutil
import signal
import sys
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from driver.checkpoint import PREPARE_COMPLETED, Checkpoint
from tests.driver.kubelet_standin import (
    DRIVER,
    KIND,
    ClaimId,
    KubeletStandin,
    allocated_claim,
    claim_id,
    result,
)
from tests.driver.plugin_process import PluginProcess, fake_gpus
from tests.fakes.apiserver import FakeApiServer

pytestmark = pytest.mark.slow

CI_SEED = 20261123
CI_ROUNDS = 25
CLAIMS = 8
MAX_KILL_DELAY = 0.12  # seconds after the first call of a round; a series lasts about that


@dataclass
class Kubelet:
    """What the kubelet was last told, per claim UID, and the call a kill cut short."""

    prepared: set[str] = field(default_factory=set)
    unprepared: set[str] = field(default_factory=set)
    pending: tuple[str, list[ClaimId]] | None = None

    def call(self, k: KubeletStandin, op: str, batch: list[ClaimId]) -> None:
        self.pending = (op, batch)
        uids = {c.uid for c in batch}
        if op == "prepare":
            out = k.prepare(batch)
            assert all(r.error == "" for r in out.values()), out
            for c in batch:
                assert [d.cdi_device_ids for d in out[c.uid].devices] == [[f"{KIND}={c.uid}"]]
            self.prepared |= uids
            self.unprepared -= uids
        else:
            assert k.unprepare(batch) == dict.fromkeys(uids, "")
            self.unprepared |= uids
            self.prepared -= uids
        self.pending = None


def on_disk(root: Path) -> set[str]:
    """The claims prepared on disk; asserts that each is all there and that nothing else is."""
    cp = Checkpoint(root / "data" / "checkpoint.json")
    cp.load()
    states = {e.uid: e.state for e in cp.entries()}
    assert set(states.values()) <= {PREPARE_COMPLETED}, f"unfinished entries after start: {states}"
    prefix, suffix = f"k8s.{DRIVER}-claim_", ".json"
    cdi = sorted(p.name for p in (root / "cdi").iterdir())
    assert all(n.startswith(prefix) and n.endswith(suffix) for n in cdi), f"CDI dir: {cdi}"
    specs = {n[len(prefix) : -len(suffix)] for n in cdi}
    dirs = {p.name for p in (root / "data" / "claims").iterdir()}
    demands = {p.name[: -len(".demand")] for p in (root / "data" / "node-state").iterdir()}
    assert set(states) == specs == dirs == demands, (states, specs, dirs, demands)
    for uid in dirs:
        d = root / "data" / "claims" / uid
        assert sorted(p.name for p in d.iterdir()) == ["limits", "metadata", "shared"], uid
        assert (d / "shared" / "accounting").is_file(), uid
    return specs


def check_after_restart(root: Path, told: Kubelet) -> None:
    prepared = on_disk(root)
    maybe = {c.uid for c in told.pending[1]} if told.pending else set()
    assert told.prepared - maybe <= prepared, f"lost: {told.prepared - maybe - prepared}"
    assert not (prepared & (told.unprepared - maybe)), f"revived: {prepared & told.unprepared}"
    assert prepared <= told.prepared | maybe, f"unknown: {prepared - told.prepared - maybe}"


def soak(root: Path, server: FakeApiServer, seed: int, rounds: int,
         say: Callable[[str], None] = lambda _: None) -> None:  # fmt: skip
    rng = random.Random(seed)
    claims = [
        claim_id(server.put(allocated_claim(f"s{i}", results=[result("gpu", f"gpu-{i % 2}",
                                                                     memory="1Gi")])))
        for i in range(CLAIMS)
    ]  # fmt: skip
    told = Kubelet()
    plugin = PluginProcess(root, server.url, fake_gpus())
    killed_mid_call = 0
    for n in range(rounds + 1):
        plugin.start()
        kubelet = KubeletStandin(root / "registry" / f"{DRIVER}-reg.sock")
        try:
            try:
                check_after_restart(root, told)
            except AssertionError as e:
                raise AssertionError(f"seed {seed} round {n}: {e}") from e
            kubelet.register()
            if told.pending is not None:  # the kubelet retries what it got no answer for
                told.call(kubelet, *told.pending)
            assert on_disk(root) == told.prepared, f"seed {seed} round {n}: after the retry"
            if n == rounds:
                break
            assert plugin.proc is not None
            killer = threading.Timer(rng.uniform(0, MAX_KILL_DELAY), plugin.proc.kill)
            killer.start()
            try:
                for _ in range(rng.randint(2, 8)):
                    op = rng.choice(("prepare", "unprepare"))
                    told.call(kubelet, op, rng.sample(claims, rng.randint(1, 4)))
                killer.join()
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.UNAVAILABLE, e
                killed_mid_call += 1
            killer.cancel()
            plugin.proc.kill()  # if the series ended before the timer
            assert plugin.wait_exit() == -signal.SIGKILL
            say(f"round {n + 1}/{rounds}: {len(told.prepared)} prepared, "
                f"{'killed mid-call' if told.pending else 'killed between calls'}")  # fmt: skip
        finally:
            kubelet.close()
            if n == rounds or sys.exc_info()[0] is not None:
                plugin.stop()
    say(f"seed {seed}: {rounds} rounds, {killed_mid_call} kills mid-call, all consistent")


def test_random_sigkill_during_prepare_and_unprepare() -> None:
    """Bounded for CI (fixed seed); the soak is the same function with more rounds."""
    root = Path(tempfile.mkdtemp(prefix="vgs", dir="/tmp"))
    try:
        with FakeApiServer() as server:
            soak(root, server, CI_SEED, CI_ROUNDS)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--seed", type=int, default=random.SystemRandom().randrange(2**32),
                   help="random seed (default: a new one, printed)")  # fmt: skip
    p.add_argument("--rounds", type=int, default=200, help="kill/restart rounds (default 200)")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error(f"--rounds {args.rounds}: allowed: 1 or more")
    print(f"seed {args.seed}, {args.rounds} rounds", flush=True)
    root = Path(tempfile.mkdtemp(prefix="vgs", dir="/tmp"))
    try:
        with FakeApiServer() as server:
            soak(root, server, args.seed, args.rounds, say=lambda m: print(m, flush=True))
    except AssertionError as e:
        print(f"FAILED: {e}\nrerun: python -m tests.driver.test_prepare_soak --seed {args.seed} "
              f"--rounds {args.rounds}; plugin log kept in {root}", file=sys.stderr)  # fmt: skip
        return 1
    shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
