"""Keyed sampling as one launch: `ddtree::keyed_choice`, a Gumbel-max sample whose noise is a pure function of
(stream seed, absolute position, token), not a generator's draw (ddtree.engine.batch_tree.keyed_choice documents
why: a stream's tokens do not depend on the batch, and every method commits what AR sampling commits).

The noise: splitmix64's finaliser `mix` (G its golden gamma) on a key per (seed, position), `state = mix(mix(seed * G +
position) + G)`, plus a key per token, `mix(v + G)`: z = mix(state + mix(v + G)), its top 23 bits k, u = (k + 0.5) /
2 ** 23 (exact in float32, never 0 or 1), and the Gumbel -log(-log(u)). (The token's key is mixed rather than
splitmix's stream step `(v + 1) * G`: Inductor's CPU code (torch 2.13) folds a multiple of an `arange` into a
vectorised arange whose overflowing products differ from eager's, `(s + arange * G) >> 30` for one.) The sample is argmax(logits * inv_t + gumbel) in float32, inv_t = 1 / temperature as a
float32 (a product: one rounding, the same on every device), the first index among equal maxima.

The composite is torch int64 ops (products wrap modulo 2 ** 64 as the unsigned ones; torch's >> on int64 is
arithmetic, so shifts are masked to be logical): about 20 passes over an [N, T, V] int64 tensor. The Triton kernel
computes the noise in registers, one program a row reading its logits once.

logits [N, T, V] (any float dtype), seeds long [N], positions long [N, T], inv_t (1 / temperature); returns long
[N, T].
"""

from __future__ import annotations

from functools import lru_cache

import torch

from ddtree.engine.kernels import FusedOp, jit_cache

__all__ = ["keyed_choice", "keyed_uniform"]

# splitmix64's constants as int64 (two's complement)
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)
_MIX1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MIX2 = 0x94D049BB133111EB - (1 << 64)


def _shr(z: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic: the sign bits masked off)."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def _mix(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser in int64 ops."""
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    return z ^ _shr(z, 31)


def keyed_uniform(seeds: torch.Tensor, positions: torch.Tensor, V: int) -> torch.Tensor:
    """The noise's uniforms, float32 [N, P, V] in (0, 1): a pure function of (seeds[i], positions[i, p], token)."""
    seeds = seeds.to(positions.device, torch.long)
    state = _mix(_mix(seeds[:, None] * _GOLDEN + positions.long()) + _GOLDEN)  # [N, P]: a key each
    keys = _token_keys.__wrapped__ if torch.compiler.is_compiling() else _token_keys  # (traced: built in the graph)
    z = _mix(state[:, :, None] + keys(V, positions.device))
    return (_shr(z, 41).float() + 0.5) * (2.0 ** -23)


@lru_cache(maxsize=64)
def _token_keys(V: int, device: torch.device) -> torch.Tensor:
    """Each token's key, mix(v + G) (int64 [V])."""
    return _mix(torch.arange(V, dtype=torch.long, device=device) + _GOLDEN)


# the composite's rows a pass (of the vocabulary's width): its int64 temporaries stay near 128 MiB each (a 27B
# target's 152k vocabulary at 64 streams x 65 nodes would take ~5 GiB a temporary in one pass)
_CHUNK = 1 << 24


def _keyed_choice(logits: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, inv_t: float) -> torch.Tensor:
    """The composite (in passes of rows past _CHUNK elements: the same values)."""
    N, T, V = logits.shape
    if N * T * V <= _CHUNK:
        return _keyed_pass(logits, seeds, positions, inv_t)
    rows = max(1, _CHUNK // V)
    flat, seed, pos = logits.reshape(N * T, 1, V), seeds[:, None].expand(N, T).reshape(-1), positions.reshape(-1, 1)
    return torch.cat([_keyed_pass(flat[r: r + rows], seed[r: r + rows], pos[r: r + rows], inv_t)[:, 0]
                      for r in range(0, N * T, rows)]).view(N, T)


def _keyed_pass(logits: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, inv_t: float) -> torch.Tensor:
    gumbel = keyed_uniform(seeds, positions, logits.shape[-1]).log_().neg_().log_().neg_()
    return (logits.float() * inv_t + gumbel).argmax(-1)


@jit_cache()
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def keyed_choice_rows(logits_ptr, seed_ptr, pos_ptr, out_ptr, T, V, stride_n, stride_t, inv_t,
                          BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        n = row // T
        t = row % T
        seed = tl.load(seed_ptr + n).to(tl.uint64)
        pos = tl.load(pos_ptr + row).to(tl.uint64)
        gold = tl.full([], 0x9E3779B97F4A7C15, tl.uint64)
        mix1 = tl.full([], 0xBF58476D1CE4E5B9, tl.uint64)
        mix2 = tl.full([], 0x94D049BB133111EB, tl.uint64)
        state = seed * gold + pos
        for i in tl.static_range(2):  # splitmix64's finaliser (uint64: products wrap, shifts are logical), twice
            if i == 1:
                state = state + gold
            state = (state ^ (state >> 30)) * mix1
            state = (state ^ (state >> 27)) * mix2
            state = state ^ (state >> 31)
        base = logits_ptr + n * stride_n + t * stride_t
        cols = tl.arange(0, BLOCK)
        best = tl.full([BLOCK], float("-inf"), tl.float32)
        arg = tl.zeros([BLOCK], tl.int64)
        for v0 in range(0, V, BLOCK):
            v = v0 + cols
            live = v < V
            x = tl.load(base + v, mask=live, other=float("-inf")).to(tl.float32)
            z = v.to(tl.uint64) + gold  # the token's key, mix(v + G)
            for j in tl.static_range(2):  # then mix(state + key)
                if j == 1:
                    z = state + z
                z = (z ^ (z >> 30)) * mix1
                z = (z ^ (z >> 27)) * mix2
                z = z ^ (z >> 31)
            u = ((z >> 41).to(tl.float32) + 0.5) * 1.1920928955078125e-07  # 2 ** -23
            val = x * inv_t - tl.log(-tl.log(u))
            better = (val > best) & live  # strictly: each lane keeps its first maximum
            best = tl.where(better, val, best)
            arg = tl.where(better, v.to(tl.int64), arg)
        top = tl.max(best, axis=0)
        first = tl.min(tl.where(best == top, arg, V), axis=0)  # the first index among the maxima
        tl.store(out_ptr + row, first)

    return keyed_choice_rows


def _launch(logits: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, inv_t: float) -> torch.Tensor:
    N, T, V = logits.shape
    if logits.stride(2) != 1 or seeds.dtype != torch.long or positions.dtype != torch.long or seeds.shape != (N,):
        return _keyed_choice(logits, seeds, positions, inv_t)
    seeds, positions = seeds.contiguous(), positions.expand(N, T).contiguous()  # (no-ops where they are)
    out = torch.empty(N, T, dtype=torch.long, device=logits.device)
    if N * T:
        _kernels()[(N * T,)](logits, seeds, positions, out, T, V, logits.stride(0), logits.stride(1), inv_t,
                             BLOCK=1024, num_warps=4, enable_fp_fusion=False)  # (x * inv_t, then + gumbel: two roundings, as torch)
    return out


_KEYED_CHOICE = FusedOp("keyed_choice(Tensor logits, Tensor seeds, Tensor positions, float inv_t) -> Tensor",
                        _keyed_choice, _launch)

keyed_choice = _KEYED_CHOICE.op
