"""The Triton kernel of `adamw_kernel` (read that module first): AdamW on blocks of many tensors, one
program a block. Its own module so the kit imports where Triton does not, and so a test can import
it again under Triton's interpreter (which `triton.jit` picks when it decorates).

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
def update(p_at, g_at, m_at, v_at, c_at, mask, lr, coef, step_size, bias2_sqrt, one_minus_beta1, beta2,
           one_minus_beta2, eps, weight_decay, HAS_COPY: tl.constexpr, MASKED: tl.constexpr):
    """One block: the `*_at` pointers are its elements' (a scalar base plus 32-bit offsets)."""
    g = load(g_at, mask, MASKED).to(tl.float32) * coef
    p = load(p_at, mask, MASKED)
    m = load(m_at, mask, MASKED).to(tl.float32)
    v = load(v_at, mask, MASKED).to(tl.float32)
    p = p * (1 - lr * weight_decay)
    m = m + one_minus_beta1 * (g - m)  # torch's lerp for a weight below 0.5
    v = v * beta2 + one_minus_beta2 * g * g
    denom = tl.div_rn(tl.sqrt_rn(v), bias2_sqrt) + eps  # IEEE-rounded, as torch's ops
    p = p - tl.div_rn(step_size * m, denom)
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
    row = offsets + t * 5  # _ROLES
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
