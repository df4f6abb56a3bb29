"""A decoder-only GPT: pre-LayerNorm blocks, causal self-attention, GELU MLP, tied embeddings.

Sized by config.ModelConfig, from a CPU smoke size (~1M parameters) to GPT-2 124M
(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50304).

Attention is torch's scaled_dot_product_attention (flash, memory-efficient or cuDNN kernels on a
GPU); model.attention forces one of them. model.loss_chunk_tokens > 0 computes the output layer
and the loss that many tokens at a time (chunked_cross_entropy), so the whole (tokens x vocab)
logits never exist at once: at GPT-2's vocabulary they are the largest activation of a step.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from config import ModelConfig


def sdpa_backends(name: str) -> list | None:
    """The SDPA kernels model.attention allows; None for auto (torch chooses, as without the key)."""
    if name == "auto":
        return None
    from torch.nn.attention import SDPBackend

    return [{"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
             "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}[name]]


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.backends = sdpa_backends(cfg.attention)
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = self._attend(q, k, v)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.resid_dropout(self.c_proj(y))

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        dropout = self.dropout if self.training else 0.0
        if self.backends is None:
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)
        from torch.nn.attention import sdpa_kernel

        with sdpa_kernel(self.backends):
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(cfg.vocab_size, cfg.n_embd),
            wpe=nn.Embedding(cfg.block_size, cfg.n_embd),
            drop=nn.Dropout(cfg.dropout),
            h=nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)]),
            ln_f=nn.LayerNorm(cfg.n_embd, bias=cfg.bias),
        ))
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # tied: one matrix, embedding and output
        self.apply(self._init_weights)
        # GPT-2: scale residual projections by 1/sqrt(2 * n_layer) so the residual stream stays O(1).
        for name, param in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @classmethod
    def empty(cls, cfg: ModelConfig, device: torch.device) -> "GPT":
        """The model with its weights allocated on `device` but never drawn, for a checkpoint to fill:
        drawing them costs 1.5 s of every restart at 124M here (on the CPU, even for a GPU run)."""
        with torch.device("meta"):
            model = cls(cfg)
        model.to_empty(device=device)
        model.transformer.wte.weight = model.lm_head.weight  # to_empty gave each of the two its own tensor
        return model

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self) -> int:
        """Parameters, without the position embeddings (as GPT-2 counts them)."""
        return sum(p.numel() for p in self.parameters()) - self.transformer.wpe.weight.numel()

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        B, T = idx.size()
        assert T <= self.cfg.block_size, f"sequence of {T} tokens, block_size is {self.cfg.block_size}"
        pos = torch.arange(0, T, dtype=torch.long, device=idx.device)  # (T,)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))  # (B, T, C)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        if targets is not None and self.cfg.loss_chunk_tokens:
            loss = chunked_cross_entropy(x.view(B * T, -1), self.lm_head.weight, targets.view(-1),
                                         self.cfg.loss_chunk_tokens)
            return None, loss  # no (B, T, vocab) logits: that is the point
        logits = self.lm_head(x)  # (B, T, vocab)
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss

    def make_optimizer(self, weight_decay: float, lr: float, betas: tuple[float, float],
                       device_type: str) -> torch.optim.AdamW:
        """AdamW with decay on matrices only (not on biases, norms or other 1-D parameters)."""
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        return torch.optim.AdamW(groups, lr=lr, betas=betas, fused=device_type == "cuda")

    def flops_per_token(self) -> float:
        """Training FLOPs per token (PaLM appendix B): 6N for the matmuls plus attention."""
        cfg = self.cfg
        return 6 * self.num_params() + 12 * cfg.n_layer * cfg.n_embd * cfg.block_size


class _ChunkedCrossEntropy(torch.autograd.Function):
    """mean cross-entropy of (hidden @ weight.T) against targets, `chunk` rows at a time. The
    gradients are computed chunk by chunk in the forward pass, while each chunk's logits exist
    (the fused linear cross-entropy of Liger and others): backward only scales them."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk):
        rows = hidden.shape[0]
        grads = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if grads else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if grads else None
        for start in range(0, rows, chunk):
            part, wanted = hidden[start:start + chunk], targets[start:start + chunk]
            logits = (part @ weight.t()).float()
            norm = torch.logsumexp(logits, dim=-1)
            total += (norm - logits.gather(1, wanted.unsqueeze(1)).squeeze(1)).sum()
            if not grads:
                continue
            # d(mean loss)/d(logits) = (softmax - one_hot) / rows
            probs = torch.exp(logits - norm.unsqueeze(1))
            probs.scatter_add_(1, wanted.unsqueeze(1), -torch.ones_like(norm).unsqueeze(1))
            probs = (probs / rows).to(part.dtype)
            grad_hidden[start:start + chunk] = probs @ weight.to(part.dtype)
            grad_weight += (probs.t() @ part).float()
        if grads:
            ctx.save_for_backward(grad_hidden, grad_weight)
            ctx.weight_dtype = weight.dtype
        return total / rows

    @staticmethod
    def backward(ctx, grad_loss):
        grad_hidden, grad_weight = ctx.saved_tensors
        return grad_hidden * grad_loss, (grad_weight * grad_loss).to(ctx.weight_dtype), None, None


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                          chunk: int) -> torch.Tensor:
    """F.cross_entropy(hidden @ weight.T, targets) (mean over rows), with at most `chunk` rows of
    logits in memory at a time. The same value and gradients up to float rounding."""
    return _ChunkedCrossEntropy.apply(hidden, weight, targets, chunk)
