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
def update(masters, grads, exp_avgs, exp_avg_sqs, copies, row, index, mask, lr, coef, step_size, bias2_sqrt,
           one_minus_beta1, beta2, one_minus_beta2, eps, weight_decay, P_ALIGN: tl.constexpr,
           G_ALIGN: tl.constexpr, M_ALIGN: tl.constexpr, V_ALIGN: tl.constexpr, C_ALIGN: tl.constexpr,
           HAS_COPY: tl.constexpr, MASKED: tl.constexpr):
    # each offset is stored in units of its role's alignment: times a constant, the compiler
    # knows the addresses aligned and loads vectors (a hint on a loaded value it would not keep)
    p_at = masters + tl.load(row) * P_ALIGN + index
    m_at = exp_avgs + tl.load(row + 2) * M_ALIGN + index
    v_at = exp_avg_sqs + tl.load(row + 3) * V_ALIGN + index
    g = load(grads + tl.load(row + 1) * G_ALIGN + index, mask, MASKED).to(tl.float32) * coef
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
        store(copies + tl.load(row + 4) * C_ALIGN + index, p, mask, MASKED)


@triton.jit
def adamw_blocks(block_tensor, tensor_first_block, offsets, numels, step_sizes, bias2_sqrts,
                 masters, grads, exp_avgs, exp_avg_sqs, copies, lr_ptr, coef_ptr,
                 one_minus_beta1, beta2, one_minus_beta2, eps, weight_decay,
                 P_ALIGN: tl.constexpr, G_ALIGN: tl.constexpr, M_ALIGN: tl.constexpr, V_ALIGN: tl.constexpr,
                 C_ALIGN: tl.constexpr, HAS_COPY: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    t = tl.load(block_tensor + pid).to(tl.int64)
    start = (pid - tl.load(tensor_first_block + t)).to(tl.int64) * BLOCK
    numel = tl.load(numels + t)
    index = start + tl.arange(0, BLOCK)
    row = offsets + t * 5  # _ROLES
    lr, coef = tl.load(lr_ptr), tl.load(coef_ptr)
    step_size, bias2_sqrt = tl.load(step_sizes + t), tl.load(bias2_sqrts + t)
    if start + BLOCK <= numel:  # a whole block: no mask (a mask of unknown bounds stops vector loads)
        update(masters, grads, exp_avgs, exp_avg_sqs, copies, row, index, index < numel, lr, coef, step_size,
               bias2_sqrt, one_minus_beta1, beta2, one_minus_beta2, eps, weight_decay, P_ALIGN, G_ALIGN,
               M_ALIGN, V_ALIGN, C_ALIGN, HAS_COPY, False)
    else:  # a tensor's last block
        update(masters, grads, exp_avgs, exp_avg_sqs, copies, row, index, index < numel, lr, coef, step_size,
               bias2_sqrt, one_minus_beta1, beta2, one_minus_beta2, eps, weight_decay, P_ALIGN, G_ALIGN,
               M_ALIGN, V_ALIGN, C_ALIGN, HAS_COPY, True)
