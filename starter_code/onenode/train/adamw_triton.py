"""The Triton kernels of `adamw_kernel` (read that module first): AdamW on blocks of many tensors, one
program a block (`adamw_blocks`), and the same for int8 moments (`adamw_int8_blocks`). Their own
module so the kit imports where Triton does not, and so a test can import it again under Triton's
interpreter (which `triton.jit` picks when it decorates).

No kernel argument may be named `params`, `specialization` or `options`: Triton 3.6's launcher binds
its own locals by those names (a `params` argument failed every launch with "failed to specialize
argument of type: dict").
"""

import triton
import triton.language as tl


@triton.jit
def load(pointer, mask, MASKED: tl.constexpr):
    if MASKED:
        return tl.load(pointer, mask=mask)
    else:
        return tl.load(pointer)


@triton.jit
def store(pointer, value, mask, MASKED: tl.constexpr):
    if MASKED:
        tl.store(pointer, value.to(pointer.dtype.element_ty), mask=mask)
    else:
        tl.store(pointer, value.to(pointer.dtype.element_ty))


@triton.jit
def adamw_math(p, g, m, v, lr, coef, step_size, bias2_sqrt, one_minus_beta1, beta2, one_minus_beta2, eps,
               weight_decay):
    """`master_update._adamw`'s step on loaded values, in float32: the new (p, m, v)."""
    g = g.to(tl.float32) * coef
    p = p * (1 - lr * weight_decay)
    m = m + one_minus_beta1 * (g - m)  # torch's lerp for a weight below 0.5
    v = v * beta2 + one_minus_beta2 * g * g
    denom = tl.div_rn(tl.sqrt_rn(v), bias2_sqrt) + eps  # IEEE-rounded, as torch's ops
    p = p - tl.div_rn(step_size * m, denom)
    return p, m, v


@triton.jit
def update(p_at, g_at, m_at, v_at, c_at, mask, lr, coef, step_size, bias2_sqrt, one_minus_beta1, beta2,
           one_minus_beta2, eps, weight_decay, HAS_COPY: tl.constexpr, MASKED: tl.constexpr):
    """One block: the `*_at` pointers are its elements' (a scalar base plus 32-bit offsets)."""
    p, m, v = adamw_math(load(p_at, mask, MASKED), load(g_at, mask, MASKED), load(m_at, mask, MASKED).to(tl.float32),
                         load(v_at, mask, MASKED).to(tl.float32), lr, coef, step_size, bias2_sqrt, one_minus_beta1,
                         beta2, one_minus_beta2, eps, weight_decay)
    store(p_at, p, mask, MASKED)
    store(m_at, m, mask, MASKED)
    store(v_at, v, mask, MASKED)
    if HAS_COPY:
        store(c_at, p, mask, MASKED)


@triton.jit
def adamw_blocks(block_tensor, tensor_first_block, offsets, numels, step_sizes, bias2_sqrts,
                 masters, grads, exp_avgs, exp_avg_sqs, copies, lr_ptr, coef_ptr,
                 one_minus_beta1, beta2, one_minus_beta2, eps, weight_decay,
                 P_ALIGN: tl.constexpr, G_ALIGN: tl.constexpr, M_ALIGN: tl.constexpr, V_ALIGN: tl.constexpr,
                 C_ALIGN: tl.constexpr, HAS_COPY: tl.constexpr, BLOCK: tl.constexpr, STEP: tl.constexpr):
    """Program i updates block i (`BLOCK` elements of one tensor), `STEP` elements at a time: the
    tables are read once for a block, and a thread holds few elements (few registers)."""
    pid = tl.program_id(0)
    t = tl.load(block_tensor + pid).to(tl.int64)
    start = (pid - tl.load(tensor_first_block + t)).to(tl.int64) * BLOCK
    remaining = tl.load(numels + t) - start
    row = offsets + t * 5  # the offsets' columns: master, gradient, exp_avg, exp_avg_sq, copy
    # each offset is stored in units of its role's alignment: times a constant (and the block's start,
    # a multiple of BLOCK), the compiler knows each base aligned and loads vectors
    p_base = masters + (tl.load(row) * P_ALIGN + start)
    g_base = grads + (tl.load(row + 1) * G_ALIGN + start)
    m_base = exp_avgs + (tl.load(row + 2) * M_ALIGN + start)
    v_base = exp_avg_sqs + (tl.load(row + 3) * V_ALIGN + start)
    c_base = copies + (tl.load(row + 4) * C_ALIGN + start)  # without copies: the masters' (never written)
    lr, coef = tl.load(lr_ptr), tl.load(coef_ptr)
    step_size, bias2_sqrt = tl.load(step_sizes + t), tl.load(bias2_sqrts + t)
    index = tl.arange(0, STEP)
    for i in tl.range(0, BLOCK, STEP):
        left = remaining - i
        if left >= STEP:  # whole: no mask (a mask of unknown bounds stops vector loads)
            update(p_base + i + index, g_base + i + index, m_base + i + index, v_base + i + index,
                   c_base + i + index, index < left, lr, coef, step_size, bias2_sqrt, one_minus_beta1, beta2,
                   one_minus_beta2, eps, weight_decay, HAS_COPY, False)
        elif left > 0:  # the tensor's last elements
            update(p_base + i + index, g_base + i + index, m_base + i + index, v_base + i + index,
                   c_base + i + index, index < left, lr, coef, step_size, bias2_sqrt, one_minus_beta1, beta2,
                   one_minus_beta2, eps, weight_decay, HAS_COPY, True)


@triton.jit
def larger(a, b):
    """`tl.max`'s combine, the kit's own: under Triton's interpreter `tl.max` (and `tl.zeros`) runs
    only if Triton was imported with TRITON_INTERPRET set (the tests set it later, and decorate this
    module again)."""
    return tl.maximum(a, b)


@triton.jit
def codes_below(x, book, SIGNED: tl.constexpr):
    """How many of the 256 sorted values at `book` are below each x in [-1, 1] (torch.bucketize's
    index). `book` is `master_update.dynamic_map`: decade d (0..6) holds k = 2^d (signed) or
    2^(d+1) means spread evenly over (10^(d-7), 10^(d-6)], one sign's, so the count follows from the
    decade of |x| and its place in it, to within one; two gathers from the map settle it, where a
    binary search took eight (the step's kernel 4% faster on one H100)."""
    a = tl.abs(x)
    d = tl.minimum(tl.maximum(tl.ceil(tl.log2(a) * 0.3010299956639812) + 6.0, 0.0), 6.0)  # |x| = 0: 0
    k = tl.exp2(d) if SIGNED else tl.exp2(d + 1.0)
    place = (a * tl.exp2((6.0 - d) * 3.321928094887362) - 0.1) * (k / 0.9) - 0.5  # |x| in the decade, in means
    below = k - (1.0 if SIGNED else 2.0) + tl.minimum(tl.maximum(tl.ceil(place), 0.0), k)  # one sign's means
    if SIGNED:  # the negatives mirror the positives, and 0 sits at 127
        count = tl.where(x > 0, 128.0 + below, 127.0 - below)
    else:
        count = 1.0 + below
    count = tl.minimum(tl.maximum(count.to(tl.int32), 0), 256)
    lower = tl.load(book + tl.maximum(count - 1, 0))
    upper = tl.load(book + tl.minimum(count, 255))
    return tl.where((count > 0) & (lower >= x), count - 1, tl.where((count < 256) & (upper < x), count + 1, count))


@triton.jit
def encode(x, book, valid, SIGNED: tl.constexpr, TOWARD_ZERO: tl.constexpr):
    """`master_update._encode` of rows of blocks [blocks, WIDTH] (`valid` marks real elements):
    the codes (uint8) and each block's scale, its largest magnitude."""
    x = tl.where(valid, x, 0.0)
    scale = tl.reduce(tl.abs(x), 1, larger)
    # a product with the scale's reciprocal, not a division an element: 18% of the kernel's time on one H100
    # (benchmarks/results/2026-12-06-h100-int8-kernel-router/). A value on a code's boundary may land one
    # code off the division's; the block's largest stays exactly +-1 (its product can fall an ulp short, and
    # rounded toward zero would lose a whole code)
    normed = x * (1.0 / tl.where(scale > 0, scale, 1.0))[:, None]
    normed = tl.where(tl.abs(x) == scale[:, None], tl.where(x < 0, -1.0, 1.0), normed)
    normed = tl.minimum(tl.maximum(normed, -1.0), 1.0)
    codes = codes_below(normed, book, SIGNED)  # the smallest code value at least each
    if TOWARD_ZERO:  # at or below each of its sign's magnitude: one below where that value is above it
        codes = tl.where((normed >= 0) & (tl.load(book + codes) != normed), codes - 1, codes)
    return codes.to(tl.uint8), scale


@triton.jit
def int8_tile(block, count, row_len, per_row, p_base, g_base, m_base, v_base, c_base, m_scales, v_scales,
              exp_avg_book, exp_avg_sq_book, lr, coef, step_size, bias2_sqrt, one_minus_beta1, beta2,
              one_minus_beta2, eps, weight_decay, HAS_COPY: tl.constexpr, WIDTH: tl.constexpr):
    """The int8 blocks `block` [TILE] of one tensor, a tile [TILE, WIDTH]: each block up to WIDTH
    (`adamw_kernel.INT8_BLOCK`) elements of one row, its moments decoded, updated and encoded again
    in registers. The `*_base` pointers are the tensor's first element (scales: first block)."""
    row = block // per_row
    column = (block - row * per_row) * WIDTH  # a row of WIDTH or fewer elements is one block
    lane = tl.arange(0, WIDTH)
    in_tensor = block < count
    valid = in_tensor[:, None] & (column[:, None] + lane[None, :] < row_len)
    at = (row * row_len + column)[:, None] + lane[None, :]
    m_scale = tl.load(m_scales + block, mask=in_tensor, other=0.0)
    v_scale = tl.load(v_scales + block, mask=in_tensor, other=0.0)
    m = tl.load(exp_avg_book + tl.load(m_base + at, mask=valid, other=0).to(tl.int32)) * m_scale[:, None]
    v = tl.load(exp_avg_sq_book + tl.load(v_base + at, mask=valid, other=0).to(tl.int32)) * v_scale[:, None]
    p, m, v = adamw_math(tl.load(p_base + at, mask=valid, other=0.0), tl.load(g_base + at, mask=valid, other=0.0),
                         m, v, lr, coef, step_size, bias2_sqrt, one_minus_beta1, beta2, one_minus_beta2, eps,
                         weight_decay)
    m_codes, m_scale = encode(m, exp_avg_book, valid, True, True)
    v_codes, v_scale = encode(v, exp_avg_sq_book, valid, False, False)
    tl.store(p_base + at, p, mask=valid)
    tl.store(m_base + at, m_codes, mask=valid)
    tl.store(v_base + at, v_codes, mask=valid)
    tl.store(m_scales + block, m_scale, mask=in_tensor)
    tl.store(v_scales + block, v_scale, mask=in_tensor)
    if HAS_COPY:
        tl.store(c_base + at, p.to(c_base.dtype.element_ty), mask=valid)


@triton.jit
def adamw_int8_blocks(block_tensor, tensor_first_block, offsets, rows, step_sizes, bias2_sqrts,
                      masters, grads, exp_avgs, exp_avg_sqs, copies, exp_avg_scales, exp_avg_sq_scales,
                      exp_avg_book, exp_avg_sq_book, lr_ptr, coef_ptr,
                      one_minus_beta1, beta2, one_minus_beta2, eps, weight_decay,
                      P_ALIGN: tl.constexpr, G_ALIGN: tl.constexpr, M_ALIGN: tl.constexpr, V_ALIGN: tl.constexpr,
                      C_ALIGN: tl.constexpr, MS_ALIGN: tl.constexpr, VS_ALIGN: tl.constexpr,
                      ROW_ALIGN: tl.constexpr, HAS_COPY: tl.constexpr, BLOCKS: tl.constexpr, TILE: tl.constexpr,
                      WIDTH: tl.constexpr):
    """Program i updates `BLOCKS` int8 blocks of one tensor, `TILE` at a time (`int8_tile`): the
    tables are read once for them all, few elements a thread at a time (few registers)."""
    pid = tl.program_id(0)
    t = tl.load(block_tensor + pid).to(tl.int64)
    row_len = tl.load(rows + t * 3) * ROW_ALIGN
    per_row = tl.load(rows + t * 3 + 1)
    count = tl.load(rows + t * 3 + 2)
    first = (pid - tl.load(tensor_first_block + t)).to(tl.int64) * BLOCKS
    table = offsets + t * 7  # master, gradient, exp_avg's and exp_avg_sq's codes, copy, their scales
    p_base = masters + tl.load(table) * P_ALIGN
    g_base = grads + tl.load(table + 1) * G_ALIGN
    m_base = exp_avgs + tl.load(table + 2) * M_ALIGN
    v_base = exp_avg_sqs + tl.load(table + 3) * V_ALIGN
    c_base = copies + tl.load(table + 4) * C_ALIGN  # without copies: the masters' (never written)
    m_scales = exp_avg_scales + tl.load(table + 5) * MS_ALIGN
    v_scales = exp_avg_sq_scales + tl.load(table + 6) * VS_ALIGN
    lr, coef = tl.load(lr_ptr), tl.load(coef_ptr)
    step_size, bias2_sqrt = tl.load(step_sizes + t), tl.load(bias2_sqrts + t)
    for i in tl.range(0, BLOCKS, TILE):
        if first + i < count:
            int8_tile(first + i + tl.arange(0, TILE), count, row_len, per_row, p_base, g_base, m_base, v_base,
                      c_base, m_scales, v_scales, exp_avg_book, exp_avg_sq_book, lr, coef, step_size, bias2_sqrt,
                      one_minus_beta1, beta2, one_minus_beta2, eps, weight_decay, HAS_COPY, WIDTH)
