"""The tree-exact GDN layer's elementwise and small-matmul steps as one launch each (`ddtree.engine.gdn.tree_layer`,
eager only: a compiled graph fuses the composites itself).

* `gdn_decays(ab, zero, decay_map, decay_mask, gates!, xy!, decays!)`: softplus of [a + dt, -b] into the decay map's
  input `gates` (a float32 `logaddexp(x, 0)`), X and Y = gates @ decay_map into `xy`, and
  E = exp(X . Y + decay_mask) into `decays` (the composite: logaddexp, the map's mm exact under any float32 matmul
  precision (`exact_sign_mm`), X . Y elementwise, exp_: `decay_products`). A batch of trees: a map (N, ...) and a
  mask (N, ...) per stream.
* `gdn_conv(past, mixed, taps, bias, index, offsets, extended!, table!, out!)`: the causal conv over each node's own
  ancestors: [past; mixed] into `extended` (what the commit reads), then per node i and channel c
  silu(bias_c + sum_k taps[k, c] * rows[window[i, k], c]) in float32 into `out` (5 ops: cat, the tap-scaled table,
  embedding_bag, the bias add, silu). `table` is the composite's scratch; the kernel reads the rows directly. A batch
  of trees (offsets of T N bags) gives each stream its own windows.
* `gdn_qk_norm(qk, weight, eps, rows!)`: the q/k rows' rms_norm (the l2-norm, gdn.LayerConsts) copied into `rows`,
  once per value head of each key head (2 ops: rms_norm, copy_).
* `gdn_delta_rule(keys, value, state, decays, gram!, from_state!, deltas!, core!)`: the chunk method's solve
  (I + (K K^T * E)) d = v - exp(c) (K S_0) (unit lower triangular) into `deltas` (what the commit reads) and the
  output (Q K^T * E) d + exp(c) (Q S_0) into `core` (7 ops: 3 bmm, mul_, addcmul, solve_triangular, addcmul_).
  `gram` and `from_state` are the composite's scratch; the kernel, one program per value head and 32 value columns,
  runs the forward substitution one row a step in registers (trees of up to 128 nodes; larger ones run the
  composite).
* `gdn_gated_norm(core, z, weight, eps, gate!, out!)`: rms_norm(core) * silu(z), silu rounded to z's dtype, the
  product written in `out`'s dtype (3 ops: rms_norm, silu, mul). `gate` is the composite's scratch.

The composites are the torch ops `tree_layer` ran before (bitwise, the CPU's path); the Triton kernels compute the
same values in float32 (their sums in another order: equal up to float32 rounding; tests/test_kernels_gdn.py).
`decays` takes a looser first-call check than the others: X . Y is c_i - c_j + log beta_j computed from path sums of
a few hundred, so any two summation orders (the CPU's mm, cuBLAS's, this kernel's) differ in E's last ~10 bits;
`delta_rule` one a little looser than float32's default (a solve in another order than cuBLAS's trsm).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ddtree.engine.kernels import FusedOp, jit_cache

__all__ = ["conv", "decays", "delta_rule", "gated_norm", "qk_norm"]


# --------------------------------------------------------------------------- composites (CPU, Meta, CUDA fallback)


def _decays(ab: torch.Tensor, zero: torch.Tensor, decay_map: torch.Tensor, decay_mask: torch.Tensor,
            gates: torch.Tensor, xy: torch.Tensor, decays: torch.Tensor) -> None:
    """ab (B, T, 2 Hv) or (B, T, 2, Hv): [a + dt | -b]; gates (B, Hv, 2T + 2), xy (B, Hv, 6T + 3) and decays
    (B Hv, T, T + 1) float32 (gdn.LayerBuffers)."""
    bsz, hv = gates.shape[0], gates.shape[1]
    n = decay_mask.shape[-2]
    torch.logaddexp(ab.view(bsz, n, 2, hv), zero, out=gates.view(bsz, hv, 2, n + 1)[..., :n].permute(0, 3, 2, 1))
    decay_products(gates.view(bsz * hv, -1), decay_map, decay_mask, xy.view(bsz * hv, -1), decays)


def exact_sign_mm(a: torch.Tensor, signs: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """a @ signs into `out`, float32, exact to float32 summation under any float32 matmul precision a user sets, for
    `signs` of 0 and +-1 entries (the GDN decay map): TF32 and bf16 matmuls round their inputs to 10 and 7 mantissa
    bits, which would move path sums of hundreds by ~0.1 (the exponents of E). `a` is split into three parts of 8
    significant bits each (what both read exactly), their products with 0 / +-1 are exact, the sums float32; one mm
    over the three stacked, then their sum. A batch of maps (`signs` (N, M, P), `a` (N, R, M), `out` (N, R, P)):
    one bmm."""
    hi = (a.view(torch.int32) & -65536).view(torch.float32)  # the top 8 significant bits (16 low bits cleared)
    rest = a - hi  # exact: what the low 16 bits held
    mid = (rest.view(torch.int32) & -65536).view(torch.float32)
    if signs.dim() == 3:
        bsz, rows = a.shape[0], a.shape[1]
        parts = torch.bmm(torch.stack([hi, mid, rest - mid], dim=1).view(bsz, 3 * rows, -1), signs)
        parts = parts.view(bsz, 3, rows, -1)
        return torch.add(parts[:, 0] + parts[:, 1], parts[:, 2], out=out)
    parts = torch.mm(torch.stack([hi, mid, rest - mid]).view(3 * a.shape[0], -1), signs).view(3, *out.shape)
    return torch.add(parts[0] + parts[1], parts[2], out=out)


def decay_products(gates: torch.Tensor, decay_map: torch.Tensor, decay_mask: torch.Tensor, xy: torch.Tensor,
                   decays: torch.Tensor) -> None:
    """X and Y = gates @ decay_map into xy (B Hv, 6T + 3), and E = exp(X . Y + decay_mask) into decays (B Hv, T, T + 1):
    the map by `exact_sign_mm`, X . Y (three terms) elementwise, so that no float32 matmul precision rounds the path
    sums before their difference c_i - c_j is taken (the eager composite and the compiled round: one home).
    A batch of N trees: a map (N, 2T + 2, 6T + 3) and a mask (N, T, T + 1) per stream, gates the streams' rows
    (N Hv, 2T + 2) in stream order."""
    if decay_map.dim() == 3:
        _batch_decay_products(gates, decay_map, decay_mask, xy, decays)
        return
    n = decay_mask.shape[0]
    exact_sign_mm(gates, decay_map, xy)
    x, y = xy[:, :3 * n].view(-1, n, 1, 3), xy[:, 3 * n:].view(-1, 1, n + 1, 3)
    torch.addcmul(decay_mask, x[..., 0], y[..., 0], out=decays)
    decays.addcmul_(x[..., 1], y[..., 1]).addcmul_(x[..., 2], y[..., 2]).exp_()


def _batch_decay_products(gates: torch.Tensor, decay_map: torch.Tensor, decay_mask: torch.Tensor, xy: torch.Tensor,
                          decays: torch.Tensor) -> None:
    """decay_products for a batch of trees: each stream's rows through its own map, its own mask added."""
    bsz, n = decay_map.shape[0], decay_mask.shape[-2]
    xy3 = xy.view(bsz, -1, xy.shape[-1])
    exact_sign_mm(gates.view(bsz, -1, gates.shape[-1]), decay_map, xy3)
    x, y = xy3[..., :3 * n].view(bsz, -1, n, 1, 3), xy3[..., 3 * n:].view(bsz, -1, 1, n + 1, 3)
    out = decays.view(bsz, -1, n, n + 1)
    torch.addcmul(decay_mask.unsqueeze(1), x[..., 0], y[..., 0], out=out)
    out.addcmul_(x[..., 1], y[..., 1]).addcmul_(x[..., 2], y[..., 2]).exp_()


def _conv(past: torch.Tensor, mixed: torch.Tensor, taps: torch.Tensor, bias: torch.Tensor | None,
          index: torch.Tensor, offsets: torch.Tensor, extended: torch.Tensor, table: torch.Tensor,
          out: torch.Tensor) -> None:
    """past (B, K, C), mixed (B, T, C); taps (K, 1, 1, C) float32; index (T K,): node i's window rows of the table
    (gdn.TreeMeta.conv_index), offsets (T,); extended (B, K + T, C); table (K, K + T, B, C) float32; out (T, B C)
    float32. A batch of trees (offsets (T B,)): index (T B K,) each stream's own windows, as rows of the table viewed
    (K (K + T) B, C) (gdn.TreeMeta)."""
    torch.cat([past, mixed], dim=1, out=extended)
    k, n = taps.shape[0], out.shape[0]
    torch.mul(extended.transpose(0, 1), taps, out=table)
    if offsets.shape[0] == n:
        summed = F.embedding_bag(index, table.view(k * (k + n), -1), offsets, mode="sum")  # (T, B C)
    else:  # (a batch: bags per node and stream)
        summed = F.embedding_bag(index, table.view(-1, table.shape[-1]), offsets, mode="sum").view(n, -1)
    if bias is not None:
        summed.view(n, extended.shape[0], -1).add_(bias)
    torch._C._nn.silu(summed, out=out)


def _qk_norm(qk: torch.Tensor, weight: torch.Tensor, eps: float, rows: torch.Tensor) -> None:
    """qk (..., 1, dk) float32, rows (..., R, dk): each normalised row copied R times."""
    rows.copy_(F.rms_norm(qk, (qk.shape[-1],), weight, eps))


def _gated_norm(core: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float, gate: torch.Tensor,
                out: torch.Tensor) -> None:
    """core (B, Hv, T, dv) float32, z (B, T, Hv dv) and gate (B, T, Hv dv) in z's dtype, out (B, T, Hv, dv)."""
    normed = F.rms_norm(core, (core.shape[-1],), weight, eps)
    torch._C._nn.silu(z, out=gate)
    bsz, n, hv, dv = out.shape
    torch.mul(normed, gate.view(bsz, n, hv, dv).transpose(1, 2), out=out.transpose(1, 2))


def _delta_rule(keys: torch.Tensor, value: torch.Tensor, state: torch.Tensor | None, decays: torch.Tensor,
                gram: torch.Tensor, from_state: torch.Tensor, deltas: torch.Tensor, core: torch.Tensor,
                depth: int) -> None:
    """The chunk method's solve (gdn module docstring): keys (B Hv, 2T, dk) [q rows; k rows], value (B, Hv, T, dv),
    state (B Hv, dk, dv) float32 or None (no prefix), decays (B Hv, T, T + 1) = E; gram (B, Hv, 2T, T) and
    from_state (B, Hv, 2T, dv) scratch; d into deltas, the output into core (B, Hv, T, dv). depth: the tree's depth
    bound (the kernel's step count; the composite's solve needs none)."""
    bsz, hv, n, dv = deltas.shape
    gram3 = gram.view(bsz * hv, 2 * n, n)
    torch.bmm(keys, keys[:, n:].transpose(1, 2), out=gram3)  # [Q; K] K^T
    e = decays.view(bsz, hv, n, n + 1)
    start = e[..., :1]  # exp(c_i)
    gram.view(bsz, hv, 2, n, n).mul_(e[..., 1:].unsqueeze(2))  # times exp(c_i - c_j) beta_j on ancestors
    if state is None:
        rhs = value
    else:
        torch.bmm(keys, state, out=from_state.view(bsz * hv, 2 * n, dv))  # [Q; K] S_0
        # the right side written where d goes: the solve then runs in place (no copy of it into its out=)
        rhs = torch.addcmul(value, start, from_state[:, :, n:], value=-1, out=deltas)
    torch.linalg.solve_triangular(gram[:, :, n:], rhs, upper=False, unitriangular=True, out=deltas)
    torch.bmm(gram3[:, :n], deltas.view(bsz * hv, n, dv), out=core.view(bsz * hv, n, dv))
    if state is not None:
        core.addcmul_(start, from_state[:, :, :n])


# --------------------------------------------------------------------------- Triton kernels


@jit_cache()
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def decays_kernel(ab_ptr, gates_ptr, map_ptr, mask_ptr, xy_ptr, dec_ptr, n, hv,
                      sab_b, sab_t, sab_c, sg, smap_b, smap, smask_b, smask, sxy, sd_bh, sd_i,
                      BT: tl.constexpr, BI: tl.constexpr, BM: tl.constexpr):
        bh = tl.program_id(0).to(tl.int64)
        b, h = bh // hv, bh % hv
        map_ptr += b * smap_b  # (a batch of trees: stream b's own map and mask; one tree: strides 0)
        mask_ptr += b * smask_b
        width = 2 * n + 2
        cols = tl.arange(0, BT)  # Y's index j = 0 .. T (j = 0 the virtual node)
        col_ok = cols < n + 1
        # Y_d[j] = sum_m gates[m] map[m, 3T + 3j + d]; the gates written on the way
        y0 = tl.zeros([BT], dtype=tl.float32)
        y1 = tl.zeros([BT], dtype=tl.float32)
        y2 = tl.zeros([BT], dtype=tl.float32)
        for m0 in range(0, width, BM):
            m = m0 + tl.arange(0, BM)
            # the decay map's input at m: [softplus(a + dt) (T), A, softplus(-b) (T), 1], A and 1 filled once
            is_a = m < n
            computed = is_a | ((m > n) & (m < 2 * n + 1))
            raw = tl.load(ab_ptr + b * sab_b + tl.where(is_a, m, m - n - 1).to(tl.int64) * sab_t
                          + tl.where(is_a, h, hv + h) * sab_c, mask=computed, other=0.0).to(tl.float32)
            u = tl.exp(-tl.abs(raw))  # softplus = logaddexp(x, 0) = max(x, 0) + log1p(exp(-|x|)), log1p exactly
            w = 1.0 + u
            soft = tl.maximum(raw, 0.0) + tl.where(w == 1.0, u, tl.log(w) * (u / (w - 1.0)))
            g = tl.where(computed, soft, tl.load(gates_ptr + bh * sg + m, mask=(m == n) | (m == 2 * n + 1), other=0.0))
            tl.store(gates_ptr + bh * sg + m, g, mask=computed)
            ok = (m < width)[:, None] & col_ok[None, :]
            base = map_ptr + m[:, None].to(tl.int64) * smap + 3 * n + 3 * cols[None, :]
            y0 += tl.sum(tl.load(base, mask=ok, other=0.0) * g[:, None], axis=0)
            y1 += tl.sum(tl.load(base + 1, mask=ok, other=0.0) * g[:, None], axis=0)
            y2 += tl.sum(tl.load(base + 2, mask=ok, other=0.0) * g[:, None], axis=0)
        out_y = xy_ptr + bh * sxy + 3 * n + 3 * cols
        tl.store(out_y, y0, mask=col_ok)
        tl.store(out_y + 1, y1, mask=col_ok)
        tl.store(out_y + 2, y2, mask=col_ok)
        # per block of rows i: X_d[i] = sum_m gates[m] map[m, 3i + d], then E = exp(mask + X . Y)
        for i0 in range(0, n, BI):
            rows = i0 + tl.arange(0, BI)
            row_ok = rows < n
            x0 = tl.zeros([BI], dtype=tl.float32)
            x1 = tl.zeros([BI], dtype=tl.float32)
            x2 = tl.zeros([BI], dtype=tl.float32)
            for m0 in range(0, width, BM):
                m = m0 + tl.arange(0, BM)
                # (the same, again: the gates are not read back)
                is_a = m < n
                computed = is_a | ((m > n) & (m < 2 * n + 1))
                raw = tl.load(ab_ptr + b * sab_b + tl.where(is_a, m, m - n - 1).to(tl.int64) * sab_t
                              + tl.where(is_a, h, hv + h) * sab_c, mask=computed, other=0.0).to(tl.float32)
                u = tl.exp(-tl.abs(raw))  # softplus = logaddexp(x, 0) = max(x, 0) + log1p(exp(-|x|)), log1p exactly
                w = 1.0 + u
                soft = tl.maximum(raw, 0.0) + tl.where(w == 1.0, u, tl.log(w) * (u / (w - 1.0)))
                g = tl.where(computed, soft, tl.load(gates_ptr + bh * sg + m, mask=(m == n) | (m == 2 * n + 1), other=0.0))
                ok = row_ok[:, None] & (m < width)[None, :]
                base = map_ptr + m[None, :].to(tl.int64) * smap + 3 * rows[:, None]
                x0 += tl.sum(tl.load(base, mask=ok, other=0.0) * g[None, :], axis=1)
                x1 += tl.sum(tl.load(base + 1, mask=ok, other=0.0) * g[None, :], axis=1)
                x2 += tl.sum(tl.load(base + 2, mask=ok, other=0.0) * g[None, :], axis=1)
            out_x = xy_ptr + bh * sxy + 3 * rows
            tl.store(out_x, x0, mask=row_ok)
            tl.store(out_x + 1, x1, mask=row_ok)
            tl.store(out_x + 2, x2, mask=row_ok)
            prod = x0[:, None] * y0[None, :]
            prod = prod + x1[:, None] * y1[None, :]
            prod = prod + x2[:, None] * y2[None, :]
            ok = row_ok[:, None] & col_ok[None, :]
            mask = tl.load(mask_ptr + rows[:, None] * smask + cols[None, :], mask=ok, other=0.0)
            tl.store(dec_ptr + bh * sd_bh + rows[:, None] * sd_i + cols[None, :], tl.exp(mask + prod), mask=ok)

    @triton.jit
    def conv_kernel(past_ptr, mixed_ptr, taps_ptr, bias_ptr, index_ptr, ext_ptr, out_ptr, n, channels, streams,
                    sp_b, sp_r, sp_c, sm_b, sm_t, sm_c, stap, se_b, se_r, se_c, so_t, so_c,
                    KERNEL: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
        i = tl.program_id(0).to(tl.int64)
        b = tl.program_id(1).to(tl.int64)
        cols = tl.program_id(2).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < channels
        ext_ty = ext_ptr.dtype.element_ty
        # extended = [past; mixed]: node i writes its input's row K + i, node 0 the K past rows too
        x = tl.load(mixed_ptr + b * sm_b + i * sm_t + cols * sm_c, mask=ok, other=0.0)
        tl.store(ext_ptr + b * se_b + (KERNEL + i) * se_r + cols * se_c, x.to(ext_ty), mask=ok)
        first = ok & (cols * 0 + i == 0)  # (masks as blocks: a scalar condition broadcast)
        for r in tl.static_range(KERNEL):
            p = tl.load(past_ptr + b * sp_b + r * sp_r + cols * sp_c, mask=first, other=0.0)
            tl.store(ext_ptr + b * se_b + r * se_r + cols * se_c, p.to(ext_ty), mask=first)
        # the window's rows of extended (oldest first), each times its tap, summed in float32
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        # node i's window: one for every stream (streams = 1), or stream b's own (a batch of trees: index (T, N, K),
        # table rows (k (K + T) + r) N + b, gdn.TreeMeta)
        bag = index_ptr + (i * streams + b % streams) * KERNEL
        for k in tl.static_range(KERNEL):
            row = tl.load(bag + k) // streams - k * (KERNEL + n)  # the table row's row of extended
            in_past = cols * 0 + row < KERNEL
            xp = tl.load(past_ptr + b * sp_b + row * sp_r + cols * sp_c, mask=ok & in_past, other=0.0)
            xm = tl.load(mixed_ptr + b * sm_b + (row - KERNEL) * sm_t + cols * sm_c, mask=ok & ~in_past, other=0.0)
            xv = tl.where(in_past, xp.to(ext_ty), xm.to(ext_ty)).to(tl.float32)
            tap = tl.load(taps_ptr + k * stap + cols, mask=ok, other=0.0)
            acc += xv * tap
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=ok, other=0.0)
        acc = acc / (1.0 + tl.exp(-acc))  # silu
        tl.store(out_ptr + i * so_t + (b * channels + cols) * so_c, acc, mask=ok)

    @triton.jit
    def qk_norm_kernel(qk_ptr, w_ptr, rows_ptr, dk, t_len, hk, r_count, eps,
                       sq_b, sq_t, sq_s, sq_h, sq_d, sr_b, sr_t, sr_s, sr_h, sr_r, sr_d, BLOCK: tl.constexpr):
        pid = tl.program_id(0).to(tl.int64)  # (b, t, s, h): s = 0 q, 1 k
        h = pid % hk
        s = (pid // hk) % 2
        t = (pid // (2 * hk)) % t_len
        b = pid // (2 * hk * t_len)
        cols = tl.arange(0, BLOCK)
        ok = cols < dk
        x = tl.load(qk_ptr + b * sq_b + t * sq_t + s * sq_s + h * sq_h + cols * sq_d, mask=ok, other=0.0)
        x = x.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, axis=0) / dk + eps)
        y = x * rstd * tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        base = rows_ptr + b * sr_b + t * sr_t + s * sr_s + h * sr_h + cols * sr_d
        for r in range(r_count):
            tl.store(base + r * sr_r, y.to(rows_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def gated_norm_kernel(core_ptr, z_ptr, w_ptr, gate_ptr, out_ptr, dv, t_len, hv, eps,
                          sc_b, sc_h, sc_t, sc_d, sz_b, sz_t, sz_c, so_b, so_t, so_h, so_d, BLOCK: tl.constexpr):
        pid = tl.program_id(0).to(tl.int64)  # (b, h, t)
        t = pid % t_len
        h = (pid // t_len) % hv
        b = pid // (t_len * hv)
        cols = tl.arange(0, BLOCK)
        ok = cols < dv
        x = tl.load(core_ptr + b * sc_b + h * sc_h + t * sc_t + cols * sc_d, mask=ok, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, axis=0) / dv + eps)
        normed = x * rstd * tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        zf = tl.load(z_ptr + b * sz_b + t * sz_t + (h * dv + cols) * sz_c, mask=ok, other=0.0).to(tl.float32)
        gate = (zf / (1.0 + tl.exp(-zf))).to(gate_ptr.dtype.element_ty).to(tl.float32)  # silu in z's dtype
        tl.store(out_ptr + b * so_b + t * so_t + h * so_h + cols * so_d,
                 (normed * gate).to(out_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def delta_rule_kernel(keys_ptr, value_ptr, state_ptr, dec_ptr, deltas_ptr, core_ptr, n, dk, dv, hv, steps,
                          sk_bh, sk_r, sk_d, sv_b, sv_h, sv_t, sv_d, ss_bh, ss_k, ss_v, se_bh, se_i,
                          sd_bh, sd_t, sd_v, sc_bh, sc_t, sc_v,
                          HAS_STATE: tl.constexpr, BT: tl.constexpr, DK: tl.constexpr, DC: tl.constexpr,
                          BV: tl.constexpr):
        bh = tl.program_id(0).to(tl.int64)  # one value head, BV of its dv columns (the solve is per column)
        b, h = bh // hv, bh % hv
        vcols = tl.program_id(1) * BV + tl.arange(0, BV)
        v_ok = vcols < dv
        rows = tl.arange(0, BT)
        r_ok = rows < n
        kq = keys_ptr + bh * sk_bh
        dec = dec_ptr + bh * se_bh
        out_ok = r_ok[:, None] & v_ok[None, :]
        # K K^T (and K S_0) over dk in slices of DC. Every product on tensor cores in 3xTF32 (three TF32 passes, about
        # float32's accuracy; plain TF32 is not used): float32 FMA dots ("ieee") spill ~100 KB a thread at 128 nodes
        # on sm_90 (bench/kernels_sm90.py), 3xTF32 ~4 KB
        gram = tl.zeros([BT, BT], dtype=tl.float32)
        from_state = tl.zeros([BT, BV], dtype=tl.float32)
        for c0 in tl.static_range(0, DK, DC):
            cs = c0 + tl.arange(0, DC)
            c_ok = cs < dk
            k_c = tl.load(kq + (n + rows[:, None]) * sk_r + cs[None, :] * sk_d, mask=r_ok[:, None] & c_ok[None, :],
                          other=0.0)
            k_t = tl.load(kq + (n + rows[None, :]) * sk_r + cs[:, None] * sk_d, mask=c_ok[:, None] & r_ok[None, :],
                          other=0.0)
            gram += tl.dot(k_c, k_t, input_precision="tf32x3")
            if HAS_STATE:
                s_c = tl.load(state_ptr + bh * ss_bh + cs[:, None] * ss_k + vcols[None, :] * ss_v,
                              mask=c_ok[:, None] & v_ok[None, :], other=0.0)
                from_state += tl.dot(k_c, s_c, input_precision="tf32x3")
        anc = r_ok[:, None] & r_ok[None, :]
        e = tl.load(dec + rows[:, None] * se_i + 1 + rows[None, :], mask=anc, other=0.0)  # E: 0 off the ancestors
        low = tl.where(rows[:, None] > rows[None, :], gram * e, 0.0)  # (I + L) d = rhs: L strictly lower
        rhs = tl.load(value_ptr + b * sv_b + h * sv_h + rows[:, None] * sv_t + vcols[None, :] * sv_d,
                      mask=out_ok, other=0.0).to(tl.float32)
        if HAS_STATE:  # v - exp(c) (K S_0)
            start = tl.load(dec + rows * se_i, mask=r_ok, other=0.0)
            rhs = rhs - start[:, None] * from_state
        # d = rhs - L d, iterated from d = rhs: L is nonzero only from a node to its ancestors, so the root's row is
        # final at once and a node at depth k after step k; `steps` = the tree's depth bound. Each step is one
        # tensor-shaped product (no row-by-row loop); a final row recomputes to the same value
        d = rhs
        for _ in range(steps):
            d = rhs - tl.dot(low, d, input_precision="tf32x3")
        tl.store(deltas_ptr + bh * sd_bh + rows[:, None] * sd_t + vcols[None, :] * sd_v, d, mask=out_ok)
        # output: (Q K^T * E) d (+ exp(c) (Q S_0)), the same slices
        qk = tl.zeros([BT, BT], dtype=tl.float32)
        q_state = tl.zeros([BT, BV], dtype=tl.float32)
        for c0 in tl.static_range(0, DK, DC):
            cs = c0 + tl.arange(0, DC)
            c_ok = cs < dk
            q_c = tl.load(kq + rows[:, None] * sk_r + cs[None, :] * sk_d, mask=r_ok[:, None] & c_ok[None, :],
                          other=0.0)
            k_t = tl.load(kq + (n + rows[None, :]) * sk_r + cs[:, None] * sk_d, mask=c_ok[:, None] & r_ok[None, :],
                          other=0.0)
            qk += tl.dot(q_c, k_t, input_precision="tf32x3")
            if HAS_STATE:
                s_c = tl.load(state_ptr + bh * ss_bh + cs[:, None] * ss_k + vcols[None, :] * ss_v,
                              mask=c_ok[:, None] & v_ok[None, :], other=0.0)
                q_state += tl.dot(q_c, s_c, input_precision="tf32x3")
        e = tl.load(dec + rows[:, None] * se_i + 1 + rows[None, :], mask=anc, other=0.0)
        out = tl.dot(qk * e, d, input_precision="tf32x3")
        if HAS_STATE:
            out += start[:, None] * q_state
        tl.store(core_ptr + bh * sc_bh + rows[:, None] * sc_t + vcols[None, :] * sc_v, out, mask=out_ok)

    return {"decays": decays_kernel, "conv": conv_kernel, "qk_norm": qk_norm_kernel, "gated_norm": gated_norm_kernel,
            "delta_rule": delta_rule_kernel}


def _pow2(n: int, least: int = 16) -> int:
    import triton

    return max(least, triton.next_power_of_2(n))


def _row_warps(block: int) -> int:
    """Warps for a program normalising one row of `block` columns (a head's 128: one warp, shuffles only)."""
    return max(1, min(8, block // 256))


def _bh(t: torch.Tensor) -> int | None:
    """The stride between t's (batch, head) pairs where its first two dims collapse into one, else None (from the
    tensor's metadata: no view dispatched, host time a launch-bound GPU pays)."""
    return t.stride(1) if t.shape[0] == 1 or t.stride(0) == t.shape[1] * t.stride(1) else None


def _launch_decays(ab, zero, decay_map, decay_mask, gates, xy, decays) -> None:
    bsz, hv = gates.shape[0], gates.shape[1]
    n = decay_mask.shape[-2]
    # a batch of trees: a map and a mask per stream (strides 0: one tree's for every row)
    smap_b, smask_b = (decay_map.stride(0), decay_mask.stride(0)) if decay_map.dim() == 3 else (0, 0)
    if ab.dim() == 4:  # (B, T, 2, Hv): [a | b] channels 2 Hv apart where they collapse
        sab_b, sab_t, s_ab, sab_c = ab.stride()
        flat = s_ab == hv * sab_c
    else:
        (sab_b, sab_t, sab_c), flat = ab.stride(), True
    sg, sxy = _bh(gates), _bh(xy)
    if (not flat or sg is None or sxy is None or gates.stride(2) != 1 or xy.stride(2) != 1
            or decay_map.stride(-1) != 1 or decay_mask.stride(-1) != 1 or decays.stride(2) != 1):
        _decays(ab, zero, decay_map, decay_mask, gates, xy, decays)  # (layouts tree_layer does not make)
        return
    bt = _pow2(n + 1)
    bi = max(16, min(bt, 4096 // bt))
    _kernels()["decays"][(bsz * hv,)](
        ab, gates, decay_map, decay_mask, xy, decays, n, hv, sab_b, sab_t, sab_c, sg, smap_b, decay_map.stride(-2),
        smask_b, decay_mask.stride(-2), sxy, decays.stride(0), decays.stride(1),
        BT=bt, BI=bi, BM=16, num_warps=4 if bt <= 64 else 8)


def _launch_conv(past, mixed, taps, bias, index, offsets, extended, table, out) -> None:
    import triton

    bsz, n, channels = mixed.shape
    k = taps.shape[0]
    if taps.stride(3) != 1 or (bias is not None and bias.stride(0) != 1) or index.stride(0) != 1:
        _conv(past, mixed, taps, bias, index, offsets, extended, table, out)  # (layouts tree_layer does not make)
        return
    block = min(1024, triton.next_power_of_2(channels))
    streams = offsets.shape[0] // n  # 1: one tree's windows for every row; N: a batch's, per stream
    _kernels()["conv"][(n, bsz, triton.cdiv(channels, block))](
        past, mixed, taps, taps if bias is None else bias, index, extended, out, n, channels, streams,
        *past.stride(), *mixed.stride(), taps.stride(0), *extended.stride(), *out.stride(),
        KERNEL=k, HAS_BIAS=bias is not None, BLOCK=block, num_warps=4)


def _launch_qk_norm(qk, weight, eps, rows) -> None:
    bsz, n, _, hk, _, dk = qk.shape
    r_count = rows.shape[4]
    assert weight.stride(0) == 1
    strides = qk.stride()
    block = _pow2(dk)
    if bsz * n:
        _kernels()["qk_norm"][(bsz * n * 2 * hk,)](
            qk, weight, rows, dk, n, hk, r_count, eps, strides[0], strides[1], strides[2], strides[3], strides[5],
            *rows.stride(), BLOCK=block, num_warps=_row_warps(block))


def _launch_gated_norm(core, z, weight, eps, gate, out) -> None:
    bsz, hv, n, dv = core.shape
    assert weight.stride(0) == 1
    block = _pow2(dv)
    if bsz * hv * n:
        _kernels()["gated_norm"][(bsz * hv * n,)](
            core, z, weight, gate, out, dv, n, hv, eps, *core.stride(), *z.stride(), *out.stride(),
            BLOCK=block, num_warps=_row_warps(block))


def _launch_delta_rule(keys, value, state, decays, gram, from_state, deltas, core, depth) -> None:
    import triton

    bsz, hv, n, dv = deltas.shape
    dk = keys.shape[-1]
    bt, dkb = _pow2(n), _pow2(dk)
    sd, sc = _bh(deltas), _bh(core)
    # (its [T, T] tiles in registers: trees of up to 128 nodes; and tree_layer's layouts)
    if bt > 128 or dkb > 256 or sd is None or sc is None or decays.stride(2) != 1:
        _delta_rule(keys, value, state, decays, gram, from_state, deltas, core, depth)
        return
    bv = min(32, _pow2(dv))
    s3 = state if state is not None else keys
    _kernels()["delta_rule"][(bsz * hv, triton.cdiv(dv, bv))](
        keys, value, s3, decays, deltas, core, n, dk, dv, hv, min(depth, n - 1), *keys.stride(),
        *value.stride(), *s3.stride(), decays.stride(0), decays.stride(1), sd, deltas.stride(2), deltas.stride(3), sc,
        core.stride(2), core.stride(3), HAS_STATE=state is not None, BT=bt, DK=dkb, DC=min(32, dkb), BV=bv,
        num_warps=8 if bt >= 64 else 4)


_DECAYS = FusedOp("gdn_decays(Tensor ab, Tensor zero, Tensor decay_map, Tensor decay_mask, Tensor(a!) gates, "
                  "Tensor(b!) xy, Tensor(c!) decays) -> ()", _decays, _launch_decays, mutated=(4, 5, 6),
                  atol=1e-5, rtol=1e-3)
_CONV = FusedOp("gdn_conv(Tensor past, Tensor mixed, Tensor taps, Tensor? bias, Tensor index, Tensor offsets, "
                "Tensor(a!) extended, Tensor(b!) table, Tensor(c!) out) -> ()", _conv, _launch_conv, mutated=(6, 8))
_QK_NORM = FusedOp("gdn_qk_norm(Tensor qk, Tensor weight, float eps, Tensor(a!) rows) -> ()", _qk_norm,
                   _launch_qk_norm, mutated=(3,))
_GATED_NORM = FusedOp("gdn_gated_norm(Tensor core, Tensor z, Tensor weight, float eps, Tensor(a!) gate, "
                      "Tensor(b!) out) -> ()", _gated_norm, _launch_gated_norm, mutated=(5,))
_DELTA_RULE = FusedOp("gdn_delta_rule(Tensor keys, Tensor value, Tensor? state, Tensor decays, Tensor(a!) gram, "
                      "Tensor(b!) from_state, Tensor(c!) deltas, Tensor(d!) core, int depth) -> ()", _delta_rule,
                      _launch_delta_rule, mutated=(6, 7), atol=1e-4, rtol=1e-4,
                      timed=True)  # (depth + 1 dependent products against cuBLAS's solve: the faster one runs, per tree size)

decays = _DECAYS.op
conv = _CONV.op
qk_norm = _QK_NORM.op
gated_norm = _GATED_NORM.op
delta_rule = _DELTA_RULE.op
