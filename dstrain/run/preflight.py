"""``python -m dstrain ... --check``: everything a run would refuse, found before a job is queued.

    python -m dstrain --config imagenet_resnet50 --deepspeed_config ds_configs/bf16.json \\
        data.root=/groups/x/imagenet --check --world 64 --device cuda

Runs the run's own checks, the same functions in the same order (dstrain/run/plan.py: the recipe and
overrides, the DeepSpeed JSON, the batch arithmetic for ``--world`` ranks; dstrain/run/startup.py: the
run directory and, with ``resume=auto``, whether its checkpoint can be continued, what the precision
needs of ``--device``, the data root and its image counts against every batch stage), then
prints the resolved plan: the loader and image counts, every batch stage (micro x accumulation x
ranks, steps per epoch, peak LR), the total steps, the precision. It writes nothing and starts no
process group: exit 0 when the run could start, 2 with the run's own one-line error when not.

``--hostfile FILE`` instead of ``--world``: the file is read as DeepSpeed's launcher reads it
(dstrain/run/hostfile.py; a bad line, a host listed twice, no host, 0 slots are refused with its file and
line) and its slots together are the world size; a batch the slots cannot split is refused with
the run's own line and the hostfile named.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from dstrain.core.errors import ConfigError
from dstrain.run import startup
from dstrain.run.hostfile import Host, slot_total
from dstrain.run.hostfile import read as read_hostfile
from dstrain.run.plan import prepare
from dstrain.settings.config import TrainConfig, validate


@dataclass(frozen=True)
class Target:
    """Where the checked run will train: its ranks and their device."""

    world: int
    device: str  # "cuda" | "cpu"
    hostfile: str | None = None  # the hostfile whose slots are the ranks, or None
    hosts: tuple[Host, ...] = ()  # its hosts, in order

    @classmethod
    def resolve(cls, world: int | None, device: str, hostfile: str | None = None) -> Target:
        """``world`` None: the slots of ``hostfile`` (read as DeepSpeed reads it,
        dstrain/run/hostfile.py), else this job's ($WORLD_SIZE, else 1); ``device`` auto: this
        machine's."""
        if world is not None and world < 1:
            raise ConfigError(f"--world {world}: the job's number of ranks must be >= 1")
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if hostfile is None:
            return cls(world or int(os.environ.get("WORLD_SIZE", "1")), device)
        hosts = read_hostfile(hostfile)
        slots = slot_total(hosts)
        if world is not None and world != slots:
            raise ConfigError(
                f"--world {world} disagrees with --hostfile {hostfile}, whose {len(hosts)} host(s) "
                f"have {slots} slots in all; drop --world (the hostfile's slots are the ranks) or "
                "fix the slots"
            )
        return cls(slots, device, hostfile, tuple(hosts))

    def ranks(self) -> str:
        """The plan's job line: how many ranks, on what, from where."""
        where = f"{self.world} rank(s) on {self.device}"
        if self.hostfile is None:
            return where
        counts = sorted({host.slots for host in self.hosts})
        each = f"{counts[0]}" if len(counts) == 1 else f"{counts[0]} to {counts[-1]}"
        return f"{where}: the slots of {self.hostfile} ({len(self.hosts)} host(s), {each} each)"


def check(cfg: TrainConfig, ds_path: str, target: Target) -> list[str]:
    """Every start-up check of a run of ``cfg`` on ``target`` (the run's own, dstrain/run/startup.py);
    the plan's lines. Writes nothing."""
    try:
        nodes = [host.slots for host in target.hosts]
        plan = prepare(cfg, ds_path, target.world, cuda=target.device == "cuda", node_sizes=nodes)
    except ConfigError as err:
        if target.hostfile is not None and refuses_the_world(cfg, target.world):
            raise ConfigError(
                f"{err}; world size {target.world} = the slots in {target.hostfile}"
            ) from None
        raise
    start = startup.check(plan, torch.device(target.device), draw_seed=False)
    return startup.plan_lines(plan, start, target.ranks())


def refuses_the_world(cfg: TrainConfig, world: int) -> bool:
    """Whether the config's own rules (the batch arithmetic, the ramp, the BN span) refuse ``world``
    ranks with a complaint they do not make of one rank: the world size is what to change."""

    def complaint(ranks: int) -> str | None:
        try:
            validate(cfg, ranks)
        except ConfigError as err:
            return str(err)
        return None

    at_world = complaint(world)
    return at_world is not None and at_world != complaint(1)
