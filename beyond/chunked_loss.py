"""
The loss head's cross-entropy without fp32 logits of the whole batch.

At GPT-2 scale the logits are the largest activation of all: 16 x 1024 tokens x 50,304 columns
is 824M values. The textbook head -- slice off the padded columns, cast to fp32, log_softmax,
pick the targets -- makes a 16-bit copy for the slice, a 3.3 GB fp32 copy for the cast, keeps
another 3.3 GB fp32 log-softmax for backward, and in backward zero-fills a padded gradient.

Here the 16-bit logits the head's matmul produced are the only full-size tensor kept. The fp32
work happens a chunk of rows at a time: forward takes each row's logsumexp (fp32) and the target's
logit; backward rebuilds each chunk's softmax from the kept logits and the logsumexp, subtracts
the one-hot target, and writes the 16-bit gradient of the logits, the padded columns zero. The
arithmetic is the textbook's (an fp32 softmax of the same 16-bit logits), in another order:
equal to ~1e-7 in fp32. Liger-Kernel and torchtitan's loss parallelism chunk the head alike.

Eager, each step of a chunk is a kernel that reads and writes the whole chunk: a cast, a
max, a subtraction, an exp, a sum, a product, a copy: ~66 bytes a logit over forward and
backward (bench.head counts them). On a GPU the fused path asks torch's softmax kernels
instead, one pass each (an fp16 chunk read as it is, half_to_float; bf16 cast first), and
writes the gradient in 16 bits straight from the product (out=): less than half the bytes.
The CPU keeps the first path (its numbers are the tests'). --compile fuses the whole head
instead (train.compile_model): there the product is a slice assignment, since dynamo refuses
an out= tensor that is not contiguous (the padded columns make each chunk's rows strided) and
would run the whole head eagerly; inductor writes the same 16-bit values in one kernel.
"""
import torch

CHUNK_ELEMENTS = 2**24  # fp32 values of one chunk: 64 MB (333 rows of GPT-2's vocabulary)


def chunk_rows(vocab):
    return max(1, CHUNK_ELEMENTS // vocab)


def fused_kernels(logits):
    """The fused path where memory passes cost most: on a GPU."""
    return logits.device.type == "cuda"


def _fp32(kernel, chunk):
    """kernel (torch._softmax or _log_softmax) of a (rows, vocab) chunk, in fp32. torch's
    CUDA kernel reads fp16 and writes fp32 in one pass (half_to_float); bf16, which it does
    not take so (pytorch's SoftMax.cu: "conversion is supported for Half type only"), and a
    CPU's chunk are cast to fp32 first."""
    if chunk.dtype == torch.float16 and chunk.device.type != "cpu":
        return kernel(chunk.contiguous(), 1, True)
    return kernel(chunk.float(), 1, False)


class ChunkedCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of logits (N, padded vocab) against targets (N,); only the first
    `vocab` columns are tokens, a target of -1 is ignored (as F.cross_entropy's ignore_index)."""

    @staticmethod
    def forward(ctx, logits, targets, vocab, fused=None):
        N, rows = logits.size(0), chunk_rows(vocab)
        fused = fused_kernels(logits) if fused is None else fused
        lse = torch.empty(N, dtype=torch.float32, device=logits.device)
        picked = torch.empty(N, dtype=torch.float32, device=logits.device)
        safe = targets.clamp(min=0).unsqueeze(1)  # (N, 1): an ignored row picks column 0
        for lo in range(0, N, rows):
            target = safe[lo:lo + rows]
            if fused:  # log p of the target, and lse = its logit - log p
                logp = _fp32(torch._log_softmax, logits[lo:lo + rows, :vocab])
                logit = logits[lo:lo + rows].gather(1, target).squeeze(1).float()
                picked[lo:lo + rows] = logit
                lse[lo:lo + rows] = logit - logp.gather(1, target).squeeze(1)
                continue
            chunk = logits[lo:lo + rows, :vocab].float()  # (rows, vocab) fp32, one chunk
            lse[lo:lo + rows] = torch.logsumexp(chunk, dim=1)
            picked[lo:lo + rows] = chunk.gather(1, target).squeeze(1)
        valid = targets != -1
        count = valid.sum()
        ctx.vocab, ctx.fused = vocab, fused
        ctx.save_for_backward(logits, targets, lse)
        return torch.where(valid, lse - picked, 0.0).sum() / count

    @staticmethod
    def backward(ctx, grad):
        logits, targets, lse = ctx.saved_tensors
        vocab, rows = ctx.vocab, chunk_rows(ctx.vocab)
        valid = targets != -1
        # d(mean loss)/d(logit) = (softmax - onehot) / count, for the rows that count
        scale = (grad / valid.sum()) * valid.float()  # (N,)
        safe = targets.clamp(min=0).unsqueeze(1)
        out = torch.empty_like(logits)
        out[:, vocab:].zero_()  # the padded columns: no token is there, no gradient
        for lo in range(0, logits.size(0), rows):
            hi = lo + rows
            if ctx.fused:  # the softmax in one pass; the product written 16-bit in another
                p = _fp32(torch._softmax, logits[lo:hi, :vocab])
                p.scatter_add_(1, safe[lo:hi], torch.full_like(p[:, :1], -1.0))
                if torch.compiler.is_compiling():  # dynamo refuses out= into a strided view
                    out[lo:hi, :vocab] = p * scale[lo:hi, None]  # and inductor fuses this
                else:
                    torch.mul(p, scale[lo:hi, None], out=out[lo:hi, :vocab])
                continue
            p = torch.exp(logits[lo:hi, :vocab].float() - lse[lo:hi, None])  # softmax, fp32
            p.scatter_add_(1, safe[lo:hi], torch.full_like(p[:, :1], -1.0))  # minus one-hot
            out[lo:hi, :vocab] = p * scale[lo:hi, None]
        return out, None, None, None


def cross_entropy(logits, targets, vocab, fused=None):
    """logits (B, T, padded vocab), targets (B, T): the mean loss over the real vocabulary.
    fused: the one-pass softmax kernels (default: where the device has them)."""
    return ChunkedCrossEntropy.apply(logits.reshape(-1, logits.size(-1)), targets.reshape(-1),
                                     vocab, fused)
