import math
import os
import subprocess
import sys
import textwrap
from dataclasses import fields

import pytest
import torch

from dstrain.core.dist import free_port
from dstrain.core.errors import ConfigError
from dstrain.techniques.models import build_model
from dstrain.techniques.optim import (
    OPTIMIZERS,
    build_optimizer,
    param_groups,
    parse_spec,
    steps_suppressed,
)
from tests.conftest import CPU_ONLY, REPO


def test_groups_by_shape_exclude_bn_and_bias_from_weight_decay():
    model = build_model("resnet_small", 10, in_channels=1, width=8)
    decay, no_decay = param_groups(model, 5e-5)
    assert decay["weight_decay"] == 5e-5 and no_decay["weight_decay"] == 0.0
    assert all(p.ndim > 1 for p in decay["params"]) and all(p.ndim <= 1 for p in no_decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


def test_unknown_optimizer_type_and_an_lr_in_the_json():
    with pytest.raises(ConfigError, match="optimizer type 'Ranger' is not supported"):
        parse_spec({"type": "Ranger", "params": {}}, "x.json")
    # the LR's one home is optim.base_lr (issue 53): the refusal names the value to move
    with pytest.raises(
        ConfigError, match=r"optimizer.params.lr=1: the LR has one home.*base_lr=1\)"
    ):
        parse_spec({"type": "SGD", "params": {"lr": 1}}, "x.json")
    assert parse_spec({"type": "SGD", "params": {}}, "x.json").params["momentum"] == 0.0
    with pytest.raises(ConfigError, match="'optimizer.params.betas' .optimizer SGD takes no such"):
        parse_spec({"type": "SGD", "params": {"betas": [0.9, 0.9]}}, "x.json")


def test_steps_suppressed_restores_the_real_step():
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=1.0, weight_decay=0.5)
    p.grad = torch.zeros(3)
    with steps_suppressed(opt):
        opt.step()
    assert torch.equal(p.detach(), torch.ones(3))
    opt.step()
    assert torch.equal(p.detach(), torch.full((3,), 0.5))


ZERO_STEP_PROBE = textwrap.dedent("""
    import os, sys, torch, deepspeed
    from dstrain.techniques.optim import steps_suppressed
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
    from dstrain.core.dist import skip_shm_op
    skip_shm_op()  # as dstrain does on CPU ranks: no JIT build of an op it never uses
    deepspeed.init_distributed(dist_backend="gloo")
    from dstrain.techniques.lars import LARS
    for mode in ("guarded", "unguarded"):
        for name in ("sgd", "lars"):
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))  # no BN: bf16 cast works on CPU
            if name == "lars":
                opt = LARS(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)
            else:
                opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)
            cfg = {"train_batch_size": 2, "bf16": {"enabled": True}, "gradient_clipping": 0.0}
            if mode == "guarded":
                with steps_suppressed(opt):
                    deepspeed.initialize(model=model, optimizer=opt, config=cfg)
            else:
                deepspeed.initialize(model=model, optimizer=opt, config=cfg)
            print(mode, name, "MOMENTUM_BUFFERS", len(opt.state))
""")


def probe(source: str, *args: str) -> str:
    """One interpreter runs ``source`` (every case of a parametrized test: one process start, not
    one per case) on DeepSpeed's CPU accelerator, as CI runs it; its stdout and stderr."""
    proc = subprocess.run(
        [sys.executable, "-c", source, str(free_port()), *args],
        cwd=REPO,
        env={**os.environ, **CPU_ONLY},
        capture_output=True,
        text=True,
        timeout=300,
    )
    return proc.stdout + proc.stderr[-3000:]


# the parametrized cases that read one probe's output, on one pytest-xdist worker (the probe runs
# once per worker that holds a case)
PROBES = pytest.mark.xdist_group("optim_probes")


@pytest.fixture(scope="module")
def zero_step_probe() -> str:
    return probe(ZERO_STEP_PROBE)


@PROBES
@pytest.mark.slow  # over ~5 s on 2 cores: the full suite only (issue 42: quick loop < 3 min)
@pytest.mark.parametrize("optimizer", ["sgd", "lars"])
@pytest.mark.parametrize("mode, buffers", [("guarded", 0), ("unguarded", 4)])
def test_deepspeed_initialize_zero_gradient_step_is_harmless(
    mode, buffers, optimizer, zero_step_probe
):
    """With bf16, DeepSpeed's wrapper steps once during initialize: unguarded it seeds momentum."""
    line = f"{mode} {optimizer} MOMENTUM_BUFFERS {buffers}"
    assert line in zero_step_probe.splitlines(), zero_step_probe  # the whole line: not "unguarded"


@pytest.mark.parametrize("path", sorted((REPO / "ds_configs").glob("*.json")), ids=lambda p: p.stem)
def test_every_shipped_optimizer_block_builds(path):
    from dstrain.run import ds_config

    spec = ds_config.read_json(path).get("optimizer")
    parsed = parse_spec(spec, str(path))
    opt = build_optimizer(build_model("resnet_small", 10, in_channels=1, width=8), parsed, 0.1)
    assert "lr" not in spec["params"]  # the LR is the trainer config's (issue 53)
    assert isinstance(opt, torch.optim.Optimizer)
    if parsed.layerwise:  # the table's layer-wise types: no trust ratio for the BN/bias group
        assert [g.get("lars_exclude", False) for g in opt.param_groups] == [False, True]
    # the BN/bias tensors (ndim <= 1) are in groups without weight decay
    assert all(g["weight_decay"] == 0.0 for g in opt.param_groups if g["params"][0].ndim <= 1)
    assert any(g["params"][0].ndim <= 1 for g in opt.param_groups)


def test_lamb_is_dstrains_lamb_everywhere(caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="dstrain"):
        opt = build_optimizer(
            torch.nn.Linear(2, 2), parse_spec({"type": "Lamb", "params": {}}), 0.01
        )
    assert type(opt).__name__ == "LAMB" and "dstrain's multi-tensor LAMB" in caplog.text


@pytest.mark.gpu  # with a GPU: DeepSpeed's FusedLamb op is built (or the builder says why not)
def test_fused_lamb_without_its_op_falls_back_and_says_why(caplog):
    """Without a GPU: dstrain's LAMB, saying why. With one: DeepSpeed's FusedLamb when its op builds,
    else the fallback with the builder's reason (never silently)."""
    import logging

    with caplog.at_level(logging.INFO, logger="dstrain"):
        opt = build_optimizer(
            torch.nn.Linear(2, 2), parse_spec({"type": "FusedLamb", "params": {}}), 0.01
        )
    if not torch.cuda.is_available():
        assert type(opt).__name__ == "LAMB"
        assert (
            "DeepSpeed's CUDA op is not usable here (it is a CUDA op and no CUDA device"
            in caplog.text
        )
    elif type(opt).__name__ != "FusedLamb":
        assert type(opt).__name__ == "LAMB" and "falling back to dstrain's" in caplog.text


def test_fused_lamb_op_build_failure_is_reported_as_one_not_as_a_config_error(monkeypatch, caplog):
    """The failure seen on an H100 image: DeepSpeed's builder parsing '9.0a' raised ValueError, and
    dstrain called it a problem with the JSON's optimizer.params."""
    import logging

    from deepspeed.ops.op_builder import FusedLambBuilder

    def broken_load(self, *args, **kwargs):
        raise ValueError("invalid literal for int() with base 10: '0a'")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(FusedLambBuilder, "is_compatible", lambda self, verbose=False: True)
    monkeypatch.setattr(FusedLambBuilder, "load", broken_load)
    with caplog.at_level(logging.INFO, logger="dstrain"):
        opt = build_optimizer(
            torch.nn.Linear(2, 2), parse_spec({"type": "FusedLamb", "params": {}}), 0.01
        )
    assert type(opt).__name__ == "LAMB"
    assert "ValueError: invalid literal for int() with base 10: '0a'" in caplog.text
    assert "falling back to dstrain's multi-tensor LAMB" in caplog.text


@pytest.mark.parametrize(
    "given, handed",
    [
        ("8.0;9.0a", "8.0;9.0"),
        ("9.0a 10.0f+PTX", "9.0;10.0+PTX"),
        ("9.0a;9.0", "9.0"),
        ("8.0;9.0+PTX", None),  # DeepSpeed parses it as it is
        ("", None),
        (None, None),
    ],
)
def test_arch_lists_deepspeed_cannot_parse_are_made_parsable(given, handed):
    from dstrain.techniques.optim import deepspeed_arch_list

    assert deepspeed_arch_list(given) == handed


def test_lamb_on_channels_last_parameters_equals_lamb_on_contiguous_ones():
    """FusedLamb asserts contiguity; dstrain's LAMB must take NHWC conv weights and give the same step.

    Both layouts get the same values and gradients (only the memory layout differs), so any
    difference beyond the norms' summation order is a layout bug."""
    from dstrain.techniques.lamb import LAMB

    torch.manual_seed(0)
    reference = build_model("resnet_small", 10, in_channels=3, width=8)
    grads = [[torch.randn_like(p) * 1e-2 for p in reference.parameters()] for _ in range(3)]
    results = []
    for fmt in (torch.contiguous_format, torch.channels_last):
        model = build_model("resnet_small", 10, in_channels=3, width=8)
        model.load_state_dict(reference.state_dict())
        model.to(memory_format=fmt)
        convs = [p for p in model.parameters() if p.ndim == 4]
        assert all(p.is_contiguous(memory_format=fmt) for p in convs)
        if fmt == torch.channels_last:
            assert not all(p.is_contiguous() for p in convs)  # the case FusedLamb refuses
        opt = LAMB(param_groups(model, 0.01, layerwise=True), lr=0.01)
        for step in grads:
            for p, g in zip(model.parameters(), step):
                p.grad = g.contiguous(memory_format=fmt) if g.ndim == 4 else g.clone()
            opt.step()
        assert all(p.is_contiguous(memory_format=fmt) for p in convs)
        results.append([p.detach().clone() for p in model.parameters()])
    moved = [not torch.equal(a, b) for a, b in zip(results[0], reference.parameters())]
    assert all(moved)
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_apply_schedule_scales_weight_decay_from_its_initial_value():
    from dstrain.techniques.optim import apply_schedule

    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3))
    opt = build_optimizer(
        model, parse_spec({"type": "LARS", "params": {"weight_decay": 1e-4}}), 1.0
    )
    apply_schedule(opt, 0.5, 0.5)
    apply_schedule(opt, 0.25, 0.25)  # relative to the initial value, not compounding
    assert [g["lr"] for g in opt.param_groups] == [0.25, 0.25]
    assert [g["weight_decay"] for g in opt.param_groups] == [pytest.approx(2.5e-5), 0.0]
    apply_schedule(opt, 0.1)  # without a factor the weight decay stays where it is
    assert opt.param_groups[0]["weight_decay"] == pytest.approx(2.5e-5)


SINGLE_RANK_PROBE = textwrap.dedent("""
    import os, sys, torch, deepspeed
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
    from dstrain.core.dist import skip_shm_op
    skip_shm_op()  # as dstrain does on CPU ranks: no JIT build of an op it never uses
    deepspeed.init_distributed(dist_backend="gloo")
    from dstrain.run import ds_config
    from dstrain.techniques.models import build_model
    from dstrain.techniques.optim import build_optimizer
    x, y = torch.randn(4, 1, 28, 28), torch.randint(0, 10, (4,))
    for path in sys.argv[2:]:
        user = ds_config.load(path)
        params = []
        for allreduce in (True, False):
            torch.manual_seed(0)
            model = build_model("resnet_small", 10, in_channels=1, width=4)
            opt = build_optimizer(model, user.optimizer, 0.1)
            engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=user.engine_config(2, 2, 1))
            engine.enable_backward_allreduce = allreduce
            initial = torch.cat([p.detach().flatten() for p in engine.module.parameters()])
            for _ in range(3):  # 3 optimizer steps of 2 accumulated micro batches
                for i in (0, 2):
                    engine.backward(torch.nn.functional.cross_entropy(engine(x[i:i + 2]), y[i:i + 2]))
                    engine.step()
            params.append(torch.cat([p.detach().flatten() for p in engine.module.parameters()]))
        print(os.path.basename(path), "EQUAL", torch.equal(params[0], params[1]),
              "MOVED", not torch.equal(params[0], initial))
""")

SINGLE_RANK_JSONS = ["fp32", "bf16", "lars_fp32"]


@pytest.fixture(scope="module")
def single_rank_probe() -> str:
    return probe(
        SINGLE_RANK_PROBE, *(str(REPO / "ds_configs" / f"{n}.json") for n in SINGLE_RANK_JSONS)
    )


@PROBES
@pytest.mark.slow  # over ~5 s on 2 cores: the full suite only (issue 42: quick loop < 3 min)
@pytest.mark.parametrize("json_name", SINGLE_RANK_JSONS)
def test_skipping_deepspeeds_single_rank_allreduce_changes_nothing(json_name, single_rank_probe):
    """dstrain.run.train sets enable_backward_allreduce=False for one rank (ZeRO 0): the weights must not change."""
    line = f"{json_name}.json EQUAL True MOVED True"
    assert line in single_rank_probe.splitlines(), single_rank_probe  # whole: not lars_fp32.json


class FakeEngine:
    def __init__(self, zero_stage: int):
        self.zero_stage, self.enable_backward_allreduce = zero_stage, True
        self.module = torch.nn.Linear(2, 2)

    def zero_optimization_stage(self) -> int:
        return self.zero_stage


@pytest.mark.parametrize(
    "world, zero_stage, allreduce", [(1, 0, False), (2, 0, True), (1, 1, True)]
)
def test_trainer_skips_deepspeeds_allreduce_only_for_one_rank_without_zero(
    world, zero_stage, allreduce
):
    from dstrain.run.train import configure_grad_sync

    engine = FakeEngine(zero_stage)
    assert configure_grad_sync(engine, None, world, seed=0) is None
    assert engine.enable_backward_allreduce is allreduce


def _group_options(optimizer) -> list[tuple]:
    """Per (weight decay, trust ratio off?) as the optimizer will apply them: the ids of the
    parameters it applies to (Muon splits the weights into filters and the rest: one entry)."""
    out: dict[tuple, frozenset] = {}
    for g in optimizer.param_groups:
        # dstrain's LARS/LAMB: a flag; FusedLamb: its per-group ratio clamp pinned to [1, 1]
        no_ratio = g.get("lars_exclude", False) or g.get("min_coeff") == g.get("max_coeff") == 1.0
        key = (g["weight_decay"], no_ratio)
        out[key] = out.get(key, frozenset()) | {id(p) for p in g["params"]}
    return sorted(((ids, *key) for key, ids in out.items()), key=lambda t: -t[1])


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_every_optimizer_path_receives_the_same_groups(kind, monkeypatch):
    """README: BN and bias tensors get no weight decay and, for layer-wise optimizers, no trust ratio,
    whichever implementation runs. FusedLamb is built for real (its CUDA op load stubbed out)."""
    import deepspeed.ops.lamb.fused_lamb as fused_lamb

    from dstrain.techniques import optim

    monkeypatch.setattr(optim, "load_fused_lamb_op", lambda: None)
    monkeypatch.setattr(fused_lamb.FusedLambBuilder, "load", lambda self, *a, **k: object())
    model = build_model("resnet_small", 10, in_channels=1, width=8)
    spec = parse_spec({"type": kind, "params": {"weight_decay": 0.01}}, "x.json")
    optimizer = build_optimizer(model, spec, 0.1)
    if kind == "fusedlamb":
        assert type(optimizer).__name__ == "FusedLamb"
    weights = frozenset(id(p) for p in model.parameters() if p.ndim > 1)
    bn_bias = frozenset(id(p) for p in model.parameters() if p.ndim <= 1)
    layerwise = OPTIMIZERS[kind].layerwise  # and the built optimizer must honour it
    assert _group_options(optimizer) == [(weights, 0.01, False), (bn_bias, 0.0, layerwise)]
    if kind == "fusedlamb":  # the weight group keeps FusedLamb's own clamp
        assert optimizer.param_groups[0]["max_coeff"] == 10.0


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_exclude_bn_bias_false_gives_one_group_everywhere(kind, monkeypatch):
    import deepspeed.ops.lamb.fused_lamb as fused_lamb

    from dstrain.techniques import optim

    monkeypatch.setattr(optim, "load_fused_lamb_op", lambda: None)
    monkeypatch.setattr(fused_lamb.FusedLambBuilder, "load", lambda self, *a, **k: object())
    model = build_model("resnet_small", 10, in_channels=1, width=8)
    params = {"weight_decay": 0.01, "exclude_bn_bias": False}
    optimizer = build_optimizer(model, parse_spec({"type": kind, "params": params}, "x.json"), 0.1)
    everything = frozenset(id(p) for p in model.parameters())
    assert _group_options(optimizer) == [(everything, 0.01, False)]


def test_bn_bias_lr_factor_sets_the_excluded_groups_lr_and_old_groups_still_step():
    """A separate LR for the BN/bias group (issue 33), set with every step's LR; and a LARS whose
    groups come from a checkpoint written before the newer settings existed still steps."""
    from dstrain.techniques.lars import LARS
    from dstrain.techniques.optim import apply_schedule, build_optimizer, parse_spec

    spec = parse_spec({"type": "LARS", "params": {"bn_bias_lr_factor": 0.1}})
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    opt = build_optimizer(model, spec, 1.0)
    apply_schedule(opt, 2.0, None, 2.0)
    assert [g["lr"] for g in opt.param_groups] == [2.0, pytest.approx(0.2)]
    old = LARS([{"params": [torch.nn.Parameter(torch.ones(3, 2))]}], lr=0.1)
    for key in ("trust_clip", "trust_decay", "momentum_correction"):
        del old.param_groups[0][key]
    old.param_groups[0]["params"][0].grad = torch.ones(3, 2)
    old.step()
    assert old.trust_summary()["trust_median"] > 0


# what each declared state layout (OPTIMIZERS[kind].state) holds per parameter tensor
TENSORS_PER_PARAM = {
    "none": 0,
    "momentum buffer": 1,
    "first and second moments": 2,
    "momentum buffers (a matrix per filter)": 1,  # a filter's: [out, in x kh x kw]
    # SOAP: the moments; its statistics and eigenbases are lists of per-dimension matrices
    "first and second moments, preconditioner statistics and eigenbases": 2,
}


@pytest.mark.parametrize("momentum", [0.0, 0.9])
@pytest.mark.parametrize("kind", sorted(set(OPTIMIZERS) - {"fusedlamb"}))  # a CUDA op: test_gpu.py
def test_each_optimizer_keeps_the_state_its_table_entry_declares(kind, momentum):
    """The resume fingerprint (dstrain/run/compat.py) takes an optimizer's state layout from its table
    entry: after one step, its state_dict holds that many tensors of each parameter's shape."""
    model = build_model("resnet_small", 10, in_channels=1, width=8)
    params = {"weight_decay": 0.01}
    if "momentum" in {f.name for f in fields(OPTIMIZERS[kind].params)}:
        params["momentum"] = momentum
    spec = parse_spec({"type": kind, "params": params}, "x.json")
    optimizer = build_optimizer(model, spec, 0.01)
    model(torch.randn(4, 1, 28, 28)).sum().backward()
    optimizer.step()
    state = optimizer.state_dict()["state"]
    shapes = [tuple(p.shape) for g in optimizer.param_groups for p in g["params"]]
    for index, shape in enumerate(shapes):
        matrix = (shape[0], math.prod(shape[1:])) if len(shape) > 2 else None
        per_param = [
            v
            for v in state.get(index, {}).values()
            if torch.is_tensor(v) and tuple(v.shape) in (shape, matrix)
        ]
        assert len(per_param) == TENSORS_PER_PARAM[spec.state_layout], (kind, index, shape)
