"""The next-token loss: from logits, or fused with the LM head a chunk of tokens at a time.

Labels convention (the whole kit): `labels` has the shape of `input_ids` and holds each position's
next-token target, already shifted (`labels[:, :-1] == input_ids[:, 1:]` for one packed sequence);
positions with -100 are ignored. The loss is the mean cross entropy, in float32, over the rest.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100
# Logits per chunk of the fused head + loss (bf16 logits and their gradient, 1 GiB together; twice
# that in float32): with a 131k vocabulary, 2048 tokens. Larger chunks mean fewer passes over the
# [vocab, hidden] weight gradient, smaller ones less memory.
CHUNK_LOGITS = 2**28


def cross_entropy_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy in float32 over the positions whose label is not -100."""
    return F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(), ignore_index=IGNORE_INDEX)


def chunk_loss_and_logit_grad(logits: torch.Tensor, target: torch.Tensor, kept: torch.Tensor,
                              with_grad: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The summed cross entropy of a chunk's rows [n, vocab] (float32) and, `with_grad`, its
    gradient with respect to the logits, softmax - one_hot, zero on rows not `kept`, in the logits'
    dtype.

    Compiled (`_chunk_math`, on a GPU) it is one reduction and one elementwise pass: the logits are
    read twice and the gradient written once, with no float32 copy of the chunk. Eager, the same
    math runs in place on the float32 logits (an elementwise form would allocate several copies):
    float32 `logits` are overwritten, as the head's own temporary may be."""
    x = logits.float()
    lse = torch.logsumexp(x, dim=-1, keepdim=True)
    loss = ((lse - x.gather(1, target[:, None])).squeeze(1) * kept).sum()
    if not with_grad:
        return loss, None
    if torch.compiler.is_compiling():
        is_target = torch.arange(x.shape[-1], device=x.device) == target[:, None]
        grad = (torch.exp(x - lse) - is_target.to(x.dtype)) * kept[:, None]
    else:
        grad = x.sub_(lse).exp_()
        grad.scatter_add_(1, target[:, None], torch.full_like(target[:, None], -1, dtype=grad.dtype))
        grad.mul_(kept[:, None])
    return loss, grad.to(logits.dtype)


@functools.cache
def _compiled_chunk_math():
    return torch.compile(chunk_loss_and_logit_grad, fullgraph=True)


def _chunk_math(logits: torch.Tensor):
    """Compiled on a GPU with Triton (it fuses the passes over the [n, vocab] chunk), eager elsewhere."""
    from torch.utils._triton import has_triton

    return _compiled_chunk_math() if logits.is_cuda and has_triton() else chunk_loss_and_logit_grad


def accumulate_product_(total: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """`total += a @ b` for a float32 `total` and bf16 (or fp16) `a`, `b`. On a GPU one cuBLAS GEMM
    adds its float32 accumulator straight into `total` (beta = 1): no product rounded to bf16, no
    separate add reading and writing `total` (on one H200 that add was 3.4% of a1-1gpu's step at
    24 x 4096, once per 2,048-token chunk over the [vocab, hidden] weight). Elsewhere the product
    is taken in the inputs' dtype and added."""
    if total.is_cuda and total.dtype == torch.float32 and a.dtype == b.dtype in (torch.bfloat16, torch.float16):
        torch.addmm(total, a, b, out_dtype=torch.float32, out=total)
    else:
        total += a @ b


class _LinearCrossEntropy(torch.autograd.Function):
    """`cross_entropy_loss(hidden @ weight.T, labels)` without the [tokens, vocab] logits.

    The forward walks the tokens in chunks; a chunk's logits exist only while its loss and its
    gradients are taken (`chunk_loss_and_logit_grad`): d(sum of losses)/d logits = softmax -
    one_hot (zero on ignored rows), in the logits' dtype as autograd would give it, then times the
    weight (for hidden) and times the chunk's hidden states (for the weight, added up in float32,
    `accumulate_product_`).
    The backward only scales them by grad / count. Same matmul FLOPs as the plain head and its
    backward, no recompute.
    """

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk: int,
                hidden_grad: bool, weight_grad: bool) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if hidden_grad else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if weight_grad else None
        math = _chunk_math(hidden)
        for start in range(0, hidden.shape[0], chunk):
            h = hidden[start:start + chunk]
            target = labels[start:start + chunk]
            kept = target != IGNORE_INDEX
            loss, grad = math(F.linear(h, weight), target.masked_fill(~kept, 0), kept, hidden_grad or weight_grad)
            total += loss
            if grad_hidden is not None:
                grad_hidden[start:start + chunk] = grad @ weight
            if grad_weight is not None:
                accumulate_product_(grad_weight, grad.t(), h)
        count = (labels != IGNORE_INDEX).sum()
        ctx.save_for_backward(grad_hidden, grad_weight, count)
        ctx.dtypes = hidden.dtype, weight.dtype
        return total / count

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        grad_hidden, grad_weight, count = ctx.saved_tensors
        scale = grad_loss.float() / count
        hidden_dtype, weight_dtype = ctx.dtypes
        return (None if grad_hidden is None else (grad_hidden.float() * scale).to(hidden_dtype),
                None if grad_weight is None else (grad_weight * scale).to(weight_dtype),
                None, None, None, None)


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                         chunk_tokens: int | None = None) -> torch.Tensor:
    """`cross_entropy_loss(F.linear(hidden, weight), labels)`, the same value to float32 rounding,
    computed `chunk_tokens` tokens at a time (default: `CHUNK_LOGITS` logits per chunk), so the
    logits of the whole batch never exist. hidden [..., H], weight [V, H], labels hidden's [...]."""
    hidden, labels = hidden.flatten(0, -2), labels.flatten()
    chunk = chunk_tokens or max(1, CHUNK_LOGITS // weight.shape[0])
    grad = torch.is_grad_enabled()
    return _LinearCrossEntropy.apply(hidden, weight, labels, chunk, grad and hidden.requires_grad,
                                     grad and weight.requires_grad)
