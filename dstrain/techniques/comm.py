"""dstrain's gradient-synchronisation layer: 2D-Torus all-reduce and compressed all-reduce with error feedback.

Chosen in the DeepSpeed JSON users swap, in a block the trainer reads,
validates and removes before DeepSpeed sees the rest::

    "dstrain_communication": {
        "mode": "torus2d",          # allreduce (flat, bucketed) | torus2d (Mikami's X x Y grid)
        "grid": "auto",             # torus2d: [X, Y], X ranks per row (put a node's GPUs in a row); auto = most square
        "compression": "sign",      # none | sign (1-bit + per-bucket scale) | powersgd (rank-r, Vogels et al.)
        "powersgd_rank": 4,
        "warmup_steps": 100,        # optimizer steps synchronised uncompressed before compression starts
        "bucket_mb": 25             # flattened gradient bucket size (MiB)
    }

When the block is present the engine's own backward all-reduce is switched off
(``engine.enable_backward_allreduce = False``) and :meth:`GradientSync.sync`
runs once per optimizer step, after the backward of the last micro batch and
before ``engine.step()``: DeepSpeed's optimizer wrapper, loss scaling and
clipping then see averaged gradients. ``communication_data_type`` (fp16/bf16)
is honoured by the uncompressed paths. ZeRO stage > 0 and ``bf16.enabled``
(whose optimizer reduces its own fp32 buffer) are rejected at start-up.

What composes
  allreduce + none      plain bucketed all-reduce (the reference)
  allreduce + sign      every rank all-gathers every rank's packed signs + scales
  allreduce + powersgd  per weight matrix: all-reduce P, orthogonalise, all-reduce Q
  torus2d + none        reduce-scatter along rows, all-reduce along columns, all-gather along rows
  torus2d + sign        the column (inter-node) phase compressed: each rank's row-reduced chunk
                        goes through the sign all-gather within its column; rows stay full precision
  torus2d + powersgd    rejected: PowerSGD needs whole weight matrices, the torus moves flat chunks

Error feedback: the part of each step's (gradient + carried error) that the
compression dropped is carried into the next step, so that summed over steps
nothing is lost (tested as an identity). A step whose gradients hold inf/NaN
(fp16 overflow; all ranks agree through one MAX all-reduce) is synchronised
uncompressed so the loss scaler sees the overflow, and the error is not updated.

gloo has no reduce-scatter: rows use ring reduce-scatter / all-gather built
from isend/irecv (bandwidth-optimal, the same traffic as NCCL's rings); on NCCL
the native ``reduce_scatter_tensor`` / ``all_gather_into_tensor`` are used.

Bytes: each rank counts the bytes it sends (ring algorithms: exact; a
library ``all_reduce`` of S bytes over W ranks: the ring's 2(W-1)/W x S).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.distributed as torch_dist

from dstrain.core import jsonspec
from dstrain.core.errors import ConfigError

log = logging.getLogger(__name__)
BLOCK = "dstrain_communication"  # ours: read by the trainer, removed before DeepSpeed sees the JSON
DTYPES = {
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
}


INTEGERS = jsonspec.Value("integers")


@dataclass
class CommConfig:
    """The ``dstrain_communication`` block: each field is its JSON key, with its kind, range and
    default (dstrain/core/jsonspec.py), declared here once."""

    mode: Literal["allreduce", "torus2d"] = jsonspec.setting(
        "allreduce",
        "allreduce | torus2d (Mikami's 2D-Torus)",
        json=jsonspec.choice("allreduce", "torus2d"),
    )
    compression: Literal["none", "sign", "powersgd"] = jsonspec.setting(
        "none",
        "none | sign (1-bit with error feedback) | powersgd",
        json=jsonspec.choice("none", "sign", "powersgd"),
    )
    grid: list[int] = jsonspec.setting(
        [], 'torus2d: [X, Y], X ranks per row; [] or "auto" = most square', json=INTEGERS
    )
    powersgd_rank: int = jsonspec.setting(
        4, "PowerSGD's rank", json=jsonspec.integer(lambda v: v >= 1, "must be >= 1")
    )
    warmup_steps: int = jsonspec.setting(
        0,
        "optimizer steps synchronised uncompressed before compression starts",
        json=jsonspec.integer(lambda v: v >= 0, "must be >= 0"),
    )
    bucket_mb: float = jsonspec.setting(
        25.0, "gradient bucket size (MiB)", json=jsonspec.positive("MiB")
    )


@dataclass(frozen=True)
class CommSpec:
    """Our gradient sync as a DeepSpeed JSON chose it: the block and ``communication_data_type``."""

    config: CommConfig
    dtype: torch.dtype | None = None  # None: the gradients' own dtype


def parse(ds: dict, source: str) -> CommSpec | None:
    """The validated ``dstrain_communication`` block of a DeepSpeed JSON, or None when it has none."""
    block = ds.get(BLOCK)
    if block is None:
        return None
    where = f"{source}: {BLOCK}"
    if not isinstance(block, dict):
        raise ConfigError(f'{where} must be an object, e.g. {{"mode": "torus2d"}}')
    if block.get("grid") == "auto":
        block = {**block, "grid": []}
    cfg = jsonspec.read_into(CommConfig, block, BLOCK, source, "dstrain does not read it")
    if cfg.mode == "torus2d" and cfg.compression == "powersgd":
        raise ConfigError(
            f"{where}: powersgd does not compose with torus2d (it needs whole weight matrices, the "
            "torus moves flat chunks). Use compression sign, or mode allreduce."
        )
    if cfg.grid and (len(cfg.grid) != 2 or min(cfg.grid) < 1):
        raise ConfigError(f'{where}.grid={cfg.grid!r}: use "auto" or [X, Y] with X*Y = world size')
    if ds.get("zero_optimization", {}).get("stage", 0) != 0:
        raise ConfigError(
            f"{where} replaces the engine's gradient all-reduce, which ZeRO stages > 0 do not use; "
            'set "zero_optimization": {"stage": 0} or remove the block'
        )
    if ds.get("bf16", {}).get("enabled", False):
        raise ConfigError(
            f"{where} does not work with bf16.enabled (its optimizer reduces a private fp32 "
            "buffer); use torch_autocast bf16 as in ds_configs/bf16.json"
        )
    name = ds.get("communication_data_type")
    if name is not None and str(name).lower() not in DTYPES:
        raise ConfigError(f"{source}: communication_data_type={name!r}: use fp32, fp16 or bf16")
    return CommSpec(cfg, DTYPES[str(name).lower()] if name is not None else None)


def grid_for(world: int, grid: list | str) -> tuple[int, int]:
    """(X, Y): X ranks per row, Y rows. ``auto`` (or []) = the most square factorisation with X >= Y."""
    if grid and grid != "auto":
        x, y = int(grid[0]), int(grid[1])
        if x * y != world:
            raise ConfigError(
                f"{BLOCK}.grid=[{x}, {y}] needs {x * y} ranks but the world size is {world}; "
                f'use "auto" or a factorisation of {world}'
            )
        return x, y
    y = max(d for d in range(1, int(math.isqrt(world)) + 1) if world % d == 0)
    return world // y, y


def pack_signs(v: torch.Tensor) -> torch.Tensor:
    """1 bit per element (1 = non-negative), 8 per uint8."""
    bits = (v >= 0).to(torch.uint8)
    bits = torch.nn.functional.pad(bits, (0, (-len(bits)) % 8)).view(-1, 8)
    return (bits << torch.arange(8, dtype=torch.uint8, device=v.device)).sum(1, dtype=torch.uint8)


def unpack_signs(packed: torch.Tensor, n: int) -> torch.Tensor:
    """+1 / -1 as float32, the inverse of pack_signs."""
    bits = (packed[:, None] >> torch.arange(8, dtype=torch.uint8, device=packed.device)) & 1
    return bits.view(-1)[:n].float() * 2 - 1


@dataclass
class _State:
    error: dict = field(default_factory=dict)  # bucket/param key -> carried compression error
    q: dict = field(default_factory=dict)  # powersgd: param key -> warm-started Q


class GradientSync:
    """Averages the gradients of ``params`` across the data-parallel world, as configured."""

    def __init__(
        self,
        cfg: CommConfig,
        params: list[torch.nn.Parameter],
        seed: int = 0,
        dtype: torch.dtype | None = None,
    ):
        self.cfg, self.dtype = cfg, dtype
        self.params = [p for p in params if p.requires_grad]
        self.world, self.rank = torch_dist.get_world_size(), torch_dist.get_rank()
        self.native = torch_dist.get_backend() == "nccl"
        self.state = _State()
        self.steps = 0
        self.bytes_sent = 0  # this rank, since the last take_bytes()
        self.total_bytes = 0  # this rank, since the start
        self.seed = seed
        if cfg.mode == "torus2d":
            self.x, self.y = grid_for(self.world, cfg.grid)
            self.row_index, self.col_index = divmod(self.rank, self.x)
            self.row_ranks = [self.row_index * self.x + c for c in range(self.x)]
            self.col_ranks = [r * self.x + self.col_index for r in range(self.y)]
            self.row_group = self.col_group = None
            for r in range(self.y):  # every rank creates every group, in the same order
                g = torch_dist.new_group([r * self.x + c for c in range(self.x)])
                self.row_group = g if r == self.row_index else self.row_group
            for c in range(self.x):
                g = torch_dist.new_group([r * self.x + c for r in range(self.y)])
                self.col_group = g if c == self.col_index else self.col_group
        log.info(
            "gradient sync: %s%s, compression %s%s, %s buckets of %.0f MiB",
            cfg.mode,
            f" {self.x}x{self.y}" if cfg.mode == "torus2d" else "",
            cfg.compression,
            f" after {cfg.warmup_steps} uncompressed steps" if cfg.warmup_steps else "",
            "fp32" if dtype is None else str(dtype).replace("torch.", ""),
            cfg.bucket_mb,
        )

    # ------------------------------------------------------------ entry point
    @torch.no_grad()
    def sync(self) -> None:
        """Average every parameter's .grad across ranks (call once per optimizer step, on every rank)."""
        grads = [p.grad for p in self.params if p.grad is not None]
        compress = self.cfg.compression != "none" and self.steps >= self.cfg.warmup_steps
        if compress and self._any_nonfinite(grads):
            compress = False  # fp16 overflow: let the loss scaler see it; keep the error as it was
        self.steps += 1
        if compress and self.cfg.compression == "powersgd":
            self._powersgd()
            return
        if not compress:
            self._sync_buckets(grads, lambda flat, key: self._uncompressed(flat))
        elif self.cfg.mode == "torus2d":
            self._sync_buckets(grads, self._sign_torus)
        else:
            self._sync_buckets(grads, self._sign_allreduce)

    def _sync_buckets(self, grads: list[torch.Tensor], reduce) -> None:
        """Flatten each bucket, ``reduce(flat, bucket index)``, copy the result back into the grads."""
        for key, bucket in enumerate(self._buckets(grads)):
            out, offset = reduce(torch.cat([g.reshape(-1) for g in bucket]), key), 0
            for g in bucket:
                g.copy_(out[offset : offset + g.numel()].view_as(g))
                offset += g.numel()

    def take_bytes(self) -> int:
        """Bytes this rank sent since the last call."""
        sent, self.bytes_sent = self.bytes_sent, 0
        return sent

    def summary(self) -> dict:
        return {
            "mode": self.cfg.mode,
            "compression": self.cfg.compression,
            "steps": self.steps,
            "bytes_sent_per_step": self.total_bytes / max(self.steps, 1),
            "grid": [self.x, self.y] if self.cfg.mode == "torus2d" else None,
        }

    def _count(self, n: float) -> None:
        self.bytes_sent += int(n)
        self.total_bytes += int(n)

    def _any_nonfinite(self, grads: list[torch.Tensor]) -> bool:
        if not grads:
            local = torch.zeros(1)
        else:  # one device reduction, no host sync per tensor
            local = (
                (~torch.stack([torch.isfinite(g).all() for g in grads]).all()).float().reshape(1)
            )
        torch_dist.all_reduce(local, op=torch_dist.ReduceOp.MAX)
        return bool(local.item())  # host sync: once per step, only when compressing

    def _buckets(self, grads: list[torch.Tensor]) -> list[list[torch.Tensor]]:
        limit = int(self.cfg.bucket_mb * 2**20 / 4)
        buckets, current, size = [], [], 0
        for g in grads:
            if current and (size + g.numel() > limit or g.dtype != current[0].dtype):
                buckets.append(current)
                current, size = [], 0
            current.append(g)
            size += g.numel()
        return buckets + ([current] if current else [])

    # ------------------------------------------------------------ uncompressed
    def _uncompressed(self, flat: torch.Tensor) -> torch.Tensor:
        work = flat.to(self.dtype) if self.dtype is not None else flat
        if self.cfg.mode == "torus2d":
            work = self._torus(work)
        else:
            self._all_reduce(work, None, self.world)
        return work.div_(self.world).to(flat.dtype)

    def _all_reduce(self, t: torch.Tensor, group, size: int) -> None:
        if size > 1:
            torch_dist.all_reduce(t, group=group)
            self._count(int(2 * (size - 1) / size * t.numel() * t.element_size()))

    def _torus(self, flat: torch.Tensor) -> torch.Tensor:
        """Sum over all ranks: reduce-scatter in the row, all-reduce the chunk in the column, all-gather in the row."""
        chunk = self._reduce_scatter_row(flat)
        self._all_reduce(chunk, self.col_group, self.y)
        return self._all_gather_row(chunk, flat)

    # ------------------------------------------------------------ rows: ring or native
    def _chunks(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return list(flat.tensor_split(self.x))

    def _reduce_scatter_row(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's chunk (index = its column) of the row-wise sum."""
        if self.x == 1:
            return flat.clone()
        if self.native:
            padded = torch.nn.functional.pad(flat, (0, (-len(flat)) % self.x))
            out = torch.empty(len(padded) // self.x, dtype=flat.dtype, device=flat.device)
            torch_dist.reduce_scatter_tensor(out, padded, group=self.row_group)
            self._count((self.x - 1) * out.numel() * out.element_size())
            return out[: len(self._chunks(flat)[self.col_index])]
        chunks = [c.clone() for c in self._chunks(flat)]
        i, x = self.col_index, self.x
        nxt, prv = self.row_ranks[(i + 1) % x], self.row_ranks[(i - 1) % x]
        for s in range(x - 1):  # after x-1 steps chunk i holds the whole row's sum
            send, recv = chunks[(i - s - 1) % x], chunks[(i - s - 2) % x]
            buf = torch.empty_like(recv)
            self._exchange(send, nxt, buf, prv)
            recv.add_(buf)
        return chunks[i]

    def _all_gather_row(self, chunk: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        if self.x == 1:
            return chunk
        sizes = [len(c) for c in self._chunks(like)]
        if self.native:
            width = -(-len(like) // self.x)
            out = torch.empty(width * self.x, dtype=chunk.dtype, device=chunk.device)
            torch_dist.all_gather_into_tensor(
                out, torch.nn.functional.pad(chunk, (0, width - len(chunk))), group=self.row_group
            )
            self._count((self.x - 1) * width * chunk.element_size())
            return torch.cat([out[k * width : k * width + n] for k, n in enumerate(sizes)])
        chunks = [torch.empty(n, dtype=chunk.dtype, device=chunk.device) for n in sizes]
        i, x = self.col_index, self.x
        chunks[i] = chunk
        nxt, prv = self.row_ranks[(i + 1) % x], self.row_ranks[(i - 1) % x]
        for s in range(x - 1):
            self._exchange(chunks[(i - s) % x], nxt, chunks[(i - s - 1) % x], prv)
        return torch.cat(chunks)

    def _exchange(self, send: torch.Tensor, dst: int, recv: torch.Tensor, src: int) -> None:
        reqs = [torch_dist.isend(send.contiguous(), dst), torch_dist.irecv(recv, src)]
        for r in reqs:
            r.wait()
        self._count(send.numel() * send.element_size())

    # ------------------------------------------------------------ 1-bit sign compression
    def _compress(self, v: torch.Tensor, key) -> tuple[torch.Tensor, torch.Tensor]:
        """(packed signs, scale) of v + carried error; the new error is what the 1-bit code drops."""
        err = self.state.error.get(key)
        v = v.float() + (err if err is not None else 0)
        scale = v.abs().mean().reshape(1)
        signs = pack_signs(v)
        self.state.error[key] = v - scale * unpack_signs(signs, len(v))
        return signs, scale

    def _sign_exchange(self, v: torch.Tensor, key, ranks: list[int], group) -> torch.Tensor:
        """Mean over ``ranks`` of each rank's 1-bit code of v: all-gather signs and scales."""
        if len(ranks) == 1:  # nothing to send: compressing would only add error
            return v.float()
        signs, scale = self._compress(v, key)
        all_signs = [torch.empty_like(signs) for _ in ranks]
        all_scales = [torch.empty_like(scale) for _ in ranks]
        torch_dist.all_gather(all_signs, signs, group=group)
        torch_dist.all_gather(all_scales, scale, group=group)
        self._count((len(ranks) - 1) * (signs.numel() + 4))  # ring all-gather: forward W-1 blocks
        total = torch.zeros(len(v), dtype=torch.float32, device=v.device)
        for s, c in zip(all_signs, all_scales):
            total.add_(unpack_signs(s, len(v)), alpha=float(c))
        return total.div_(len(ranks))

    def _sign_allreduce(self, flat: torch.Tensor, key) -> torch.Tensor:
        return self._sign_exchange(flat, key, list(range(self.world)), None).to(flat.dtype)

    def _sign_torus(self, flat: torch.Tensor, key) -> torch.Tensor:
        """Rows full precision (reduce-scatter), columns 1-bit (the slow inter-node links), rows all-gather."""
        chunk = self._reduce_scatter_row(flat.float())
        # mean over the column of row sums
        chunk = self._sign_exchange(chunk, key, self.col_ranks, self.col_group)
        return self._all_gather_row(chunk, flat).div_(self.x).to(flat.dtype)

    # ------------------------------------------------------------ PowerSGD
    def _powersgd(self) -> None:
        r = self.cfg.powersgd_rank
        small = []
        for key, p in enumerate(self.params):
            g = p.grad
            if g is None:
                continue
            m = g.reshape(g.shape[0], -1) if g.ndim > 1 else None
            if m is None or min(m.shape) <= r:  # vectors and thin matrices: cheaper to send whole
                small.append(g)
                continue
            err = self.state.error.get(key)
            mat = m.float() + (err if err is not None else 0)
            q = self.state.q.get(key)
            if q is None:  # the same start on every rank: seeded by parameter index
                gen = torch.Generator(device="cpu").manual_seed(self.seed * 7919 + key)
                q = torch.randn(mat.shape[1], r, generator=gen).to(mat.device)
            pm = mat @ q
            self._all_reduce(pm, None, self.world)
            pm = torch.linalg.qr(pm.div_(self.world)).Q
            q = mat.t() @ pm
            self._all_reduce(q, None, self.world)
            q.div_(self.world)
            approx = pm @ q.t()
            self.state.error[key] = mat - approx
            self.state.q[key] = q
            g.copy_(approx.view_as(g))
        self._sync_buckets(small, lambda flat, key: self._uncompressed(flat))
