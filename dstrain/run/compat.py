"""Resume compatibility: what a resumed run may change, checked before anything is built or written.

A run records what its checkpoints depend on in ``meta.json`` (``"resume"``: :func:`fingerprint`).
``resume=auto`` compares that record with the new config and DeepSpeed JSON first; a checkpoint
whose train state a newer dstrain wrote, or a difference in :data:`MUST_MATCH`, is refused in one
line naming every difference and the way out, and the run directory is left byte-for-byte as it
was. Everything else may change on resume (docs/faults.md
lists it): epochs, the LR and its schedule, optimizer hyperparameters that keep the state layout
(``lr``, ``momentum`` > 0, ``weight_decay``, ``trust_coefficient``, betas, ...), the batch size and
ramp of epochs not yet started, the seed at an epoch boundary, gradient clipping,
label smoothing, logging, evaluation, checkpoint and fault settings, Final Polishing, the data root,
loader threads and prefetch, the micro batch (the global batch stays), ``model.channels_last``,
``model.compile`` (its mode and backend) and ``model.bn_span``, and the gradient communication
block.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from dstrain.core.errors import ConfigError
from dstrain.loop.trainer import refuse_newer_state
from dstrain.run.ds_config import DeepSpeedSpec
from dstrain.run.rundir import MODEL_KEYS, check_same_model
from dstrain.settings.config import TrainConfig
from dstrain.settings.ramp import batch_arithmetic, global_size_at

log = logging.getLogger(__name__)

# what each difference breaks, said in the refusal
MUST_MATCH = {
    "model": "the checkpoint holds this network's tensors",
    "optimizer.type": "the optimizer state belongs to one optimizer",
    "optimizer state": "momentum 0 keeps no momentum buffer, momentum > 0 needs one",
    "optimizer.params.exclude_bn_bias": "it sets the number of parameter groups in the state",
    "precision": "DeepSpeed's engines keep different master weights and scaler state",
    "zero_optimization.stage": "ZeRO stages partition the optimizer state differently",
    "data.dataset": "the model was trained on this data",
    "data.holdout": "it decides which training images train and which evaluate",
    "data.last_batch": "it decides where each epoch starts in its order (fill: after the images "
    "the epoch before took from it)",
}


def fingerprint(cfg: TrainConfig, spec: DeepSpeedSpec, world: int) -> dict:
    """What the checkpoints of this run depend on (written to meta.json, compared on resume)."""
    fp = {
        "model": {k: getattr(cfg.model, k) for k in MODEL_KEYS},
        "optimizer.type": spec.optimizer.kind,
        "optimizer state": spec.optimizer.state_layout,
        "optimizer.params.exclude_bn_bias": spec.optimizer.exclude_bn_bias,
        "precision": spec.precision,
        "zero_optimization.stage": int(spec.engine.get("zero_optimization", {}).get("stage", 0)),
        "batch.global_size": cfg.batch.global_size,
        "batch.ramp": [list(step) for step in cfg.batch.ramp],
        "seed": cfg.seed,
        "data.dataset": cfg.data.dataset,
        "data.holdout": cfg.data.holdout,
        "data.last_batch": cfg.data.last_batch,
        "world_size": world,
    }
    return json.loads(json.dumps(fp, default=list))  # as meta.json will hold it (lists, not tuples)


def world_size_may_change(fp: dict) -> bool:
    """ZeRO 0 keeps the whole optimizer state in rank 0's file, except DeepSpeed's bf16 engine, which
    saves its FP32 master state per rank; ZeRO > 0 partitions it over the ranks."""
    return fp["zero_optimization.stage"] == 0 and fp["precision"] != "bf16"


def global_batch_at(fp: dict, epoch: int) -> int:
    """The global batch of ``epoch`` (0-based) under a fingerprint's ``batch.global_size`` and ramp."""
    return global_size_at(epoch, fp["batch.global_size"], fp["batch.ramp"])


def differences(saved: dict, now: dict, epochs_done: int = 0, mid_epoch: bool = False) -> list[str]:
    """Every refused difference as ``key: X there, Y here (why)``; empty when the resume may go on.

    ``epochs_done`` / ``mid_epoch``: where the checkpoint stands. The batch plan must be the same
    for the epochs done and the one being continued (a ramp switch may be added or moved later);
    the seed, which orders each epoch's data, only for an epoch being continued."""
    out = []
    for epoch in range(epochs_done + int(mid_epoch)):
        there, here = global_batch_at(saved, epoch), global_batch_at(now, epoch)
        if there != here:
            out.append(
                f"global batch {there} there, {here} here in epoch {epoch + 1} (batch.global_size "
                "and batch.ramp may change only for epochs not yet started)"
            )
            break
    filled = now.get("data.last_batch") == "fill"
    if (mid_epoch or filled) and saved["seed"] != now["seed"]:
        out.append(
            f"seed {saved['seed']!r} there, {now['seed']!r} here (it orders the data of the epoch "
            + (
                "to come, whose first images the last epoch took (data.last_batch=fill))"
                if filled and not mid_epoch
                else "being continued; resume at an epoch boundary to change it)"
            )
        )
    for key, why in MUST_MATCH.items():
        if key not in saved or saved[key] == now[key]:
            continue
        if key == "model":
            changed = [k for k in MODEL_KEYS if saved["model"].get(k) != now["model"][k]]
            out += [
                f"model.{k}={saved['model'].get(k)!r} there, {now['model'][k]!r} here"
                for k in changed
            ]
            continue
        out.append(f"{key} {saved[key]!r} there, {now[key]!r} here ({why})")
    moved = saved.get("world_size", now["world_size"]) != now["world_size"]
    if moved and not world_size_may_change(saved):
        out.append(
            f"world size {saved['world_size']} there, {now['world_size']} here (with "
            f"zero_optimization.stage {saved['zero_optimization.stage']} and precision "
            f"{saved['precision']} the optimizer state is saved per rank)"
        )
    return out


def saved_fingerprint(run_dir: Path) -> dict | None:
    """The fingerprint in RUN_DIR/meta.json, or None (a run from before it was recorded)."""
    try:
        return json.loads((run_dir / "meta.json").read_text()).get("resume")
    except (OSError, ValueError, AttributeError):
        return None


def check(run_dir: Path, cfg: TrainConfig, spec: DeepSpeedSpec, world: int, state: dict) -> None:
    """Refuse a resume that cannot continue the run in ``run_dir`` from the checkpoint whose trainer
    state is ``state``; writes nothing either way."""
    # a newer dstrain's train state: the very check the run's resume makes, found before anything
    # is built or written (and by --check)
    refuse_newer_state(state)
    check_batch_switches(cfg, world, state.get("batch_switches") or [])
    saved = saved_fingerprint(run_dir)
    if saved is None:
        log.warning(
            "%s records no resume fingerprint (a run from an older dstrain): only the model is compared",
            run_dir / "meta.json",
        )
        check_same_model(run_dir, cfg.model)  # from its config.yaml
        return
    done, mid = int(state.get("epoch", 0)), bool(state.get("epoch_step", 0))
    diff = differences(saved, fingerprint(cfg, spec, world), done, mid)
    if diff:
        raise ConfigError(
            f"run_dir={str(run_dir)!r} cannot be resumed with this config: {'; '.join(diff)}. "
            "Resume with the settings it was started with (its config.yaml and meta.json), or start a "
            "new run_dir (docs/faults.md lists what may change on resume)"
        )


def check_batch_switches(cfg: TrainConfig, world: int, switches: list) -> None:
    """batch.follow_noise's switches so far (the train state's): the resume rebuilds them
    (dstrain/techniques/noise_scale.py: NoiseRamp), so it must follow the noise too, and each
    switched batch must be whole micro batches on this world's ranks."""
    if not switches:
        return
    done = ", ".join(f"{size} from epoch {epoch + 1}" for epoch, size, *_ in switches)
    if not cfg.batch.follow_noise:
        raise ConfigError(
            f"the run's batch followed the noise scale ({done}); resume it with "
            "batch.follow_noise=true"
        )
    micro, _ = batch_arithmetic(cfg.batch.global_size, cfg.batch.micro_per_rank, world)
    for epoch, size, *_ in switches:
        if size % (micro * world):
            raise ConfigError(
                f"batch.follow_noise: the run switched to global batch {size} at epoch "
                f"{epoch + 1}, not whole micro batches of {micro} on {world} ranks; resume on a "
                "world size that divides it"
            )
