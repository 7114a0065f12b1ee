"""TorchEngine's sampler: temperature, top-k / top-p, and a seeded inverse-CDF draw per row.

Why not ``torch.multinomial``: it draws from one generator for the whole batch, so a request's
tokens would depend on what else is in the batch; here each request brings its own uniforms
(drawn from a generator seeded by the request's seed), so a seeded request samples the same
tokens in any batch, and a two-level search avoids building a ``[k, V]`` cumulative sum.

    z = logits / T  (T = 1 for greedy),   logprob(token) = log_softmax(z)[token] over the full vocab
    top-k / top-p remove tokens from z (never renormalising the reported logprob);
    token = first index i with cdf_i > u · cdf_V,  cdf = running sum of exp(z_kept - max z) in
            float64, u ~ U(0, 1): the request's uniform for this position
    greedy (T == 0): token = argmax(logits).
"""

from __future__ import annotations

import torch

_CDF_BLOCK = 256  # vocabulary block of the two-level inverse-CDF search in ``inverse_cdf``


def request_uniforms(seed: int, n: int) -> torch.Tensor:
    """The uniforms ``Float32[n]`` in [0, 1) of one request: ``u[t]`` draws its token ``t``.

    Drawn at once from a CPU generator seeded with ``seed``; a CPU generator gives the same
    numbers, draw for draw, as ``n`` separate ``torch.rand(1)`` calls, and the same on every device
    the engine runs on.
    """
    return torch.rand(n, generator=torch.Generator().manual_seed(seed))


def sample_next(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    u: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row; return ``(tokens Long[k], logprobs Float32[k])``.

    logits Float[k, V]; temperature Float[k] (0 = greedy); top_k Long[k] (0 = off);
    top_p Float[k] (1 = off); u Float[k] in [0, 1): each row's uniform (unused for greedy rows).

    z = logits / T (T = 1 for greedy rows);  logprob = z[token] - logsumexp(z)  (full vocabulary)
    sampling: inverse CDF of softmax(z restricted to top-k / top-p): token = first i with
    cdf_i > u * cdf_V, with cdf the running sum of exp(z - max z) in float64 (see
    :func:`inverse_cdf`).
    """
    k = logits.shape[0]
    z = logits.float()
    greedy = temperature <= 0
    if bool((temperature != 1).any()):
        z = z / torch.where(greedy, torch.ones_like(temperature), temperature)[:, None]
    zmax = z.amax(dim=-1, keepdim=True)
    e = (z - zmax).exp_()  # softmax numerators, [k, V], max entry 1
    sampled_rows = (~greedy).nonzero().flatten()
    n_sampled = sampled_rows.numel()
    filtered = n_sampled > 0 and bool(((top_k > 0) | (top_p < 1))[~greedy].any())
    block_mass = block_sums(e)  # [k, n_blocks] float64
    # logsumexp(z) = zmax + log Σ exp(z - zmax)
    lse = zmax.squeeze(-1).double() + block_mass.sum(-1).log()
    if n_sampled < k:
        tokens = z.argmax(dim=-1)
    else:
        tokens = torch.empty(k, dtype=torch.long, device=logits.device)
    if n_sampled:
        all_rows = n_sampled == k
        probs, mass = (e, block_mass) if all_rows else (e[sampled_rows], block_mass[sampled_rows])
        if filtered:
            probs = filter_top_k_top_p(probs, top_k[sampled_rows], top_p[sampled_rows])
            mass = block_sums(probs)
        tokens[sampled_rows] = inverse_cdf(probs, mass, u[sampled_rows])
    logprobs = (z.gather(-1, tokens[:, None]).squeeze(-1).double() - lse).float()
    return tokens, logprobs


def sample_unfiltered(
    logits: torch.Tensor, temperature: torch.Tensor, u: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`sample_next` for a batch whose rows are all sampled (``T > 0``) without top-k /
    top-p, the usual rollout: the same math, as one function of fixed shapes without host syncs
    (what ``TorchEngine(compile=True)`` compiles). ``(tokens Long[k], logprobs Float32[k])``."""
    z = logits.float() / temperature[:, None]
    zmax = z.amax(dim=-1, keepdim=True)
    e = (z - zmax).exp()
    block_mass = block_sums(e)
    lse = zmax.squeeze(-1).double() + block_mass.sum(-1).log()
    tokens = inverse_cdf(e, block_mass, u)
    logprobs = (z.gather(-1, tokens[:, None]).squeeze(-1).double() - lse).float()
    return tokens, logprobs


def block_sums(probs: torch.Tensor) -> torch.Tensor:
    """Float64 sums of consecutive ``_CDF_BLOCK``-token blocks of ``probs [k, V]`` (the last
    block may be shorter): ``[k, ceil(V / _CDF_BLOCK)]``."""
    k, vocab = probs.shape
    full = vocab // _CDF_BLOCK * _CDF_BLOCK
    parts = []
    if full:
        parts.append(probs[:, :full].reshape(k, -1, _CDF_BLOCK).sum(-1, dtype=torch.float64))
    if full < vocab:
        parts.append(probs[:, full:].sum(-1, keepdim=True, dtype=torch.float64))
    return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]


def inverse_cdf(probs: torch.Tensor, block_mass: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """First index i with cdf_i > u * cdf_V per row: ``Long[k]``.

    ``probs [k, V] >= 0``, unnormalised; ``block_mass = block_sums(probs)``; ``u [k]`` in [0, 1).
    Two levels, so that no [k, V] cumulative sum is built: the block sums locate the block, one
    cumulative sum inside that block locates the token. The drawn token always has positive mass,
    whatever the rounding of the two summation orders.
    """
    k, vocab = probs.shape
    block_cdf = block_mass.cumsum(dim=-1)
    target = u.double() * block_cdf[:, -1]
    n_blocks = block_cdf.shape[1]
    b = torch.searchsorted(block_cdf, target[:, None], right=True).clamp_(max=n_blocks - 1)
    before = block_cdf.gather(1, b).squeeze(-1) - block_mass.gather(1, b).squeeze(-1)
    # the tokens of each row's block (a short last block is padded with zero mass)
    idx = b * _CDF_BLOCK + torch.arange(_CDF_BLOCK, device=probs.device)[None, :]
    inside = idx < vocab
    seg = probs.gather(1, idx.clamp(max=vocab - 1)).masked_fill_(~inside, 0.0)
    seg_cdf = seg.double().cumsum_(dim=-1)
    rest = (target - before).clamp_(min=0.0)[:, None]  # >= 0: the first pick has positive mass
    j = torch.searchsorted(seg_cdf, rest, right=True).squeeze(-1)
    # rounding can put the target past the block's last positive token: take that token then
    positive = torch.arange(_CDF_BLOCK, device=probs.device)[None, :].expand(k, -1)
    last_positive = positive.masked_fill(seg <= 0, -1).amax(dim=-1)
    j = torch.minimum(j, last_positive)
    return b.squeeze(-1) * _CDF_BLOCK + j


def filter_top_k_top_p(
    probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Zero the (unnormalised) probabilities outside each row's top-k and top-p nucleus.

    probs Float[k, V] >= 0. top-k keeps ranks < k (k = 0: all); top-p keeps a token when the
    normalised mass of the tokens ranked before it is < p (the most likely token is always kept).
    Rows with neither filter come back unchanged.

    Only the head of each row is ranked: ``topk(n)`` with n = 64, 1024, 16384, ... until every
    filtered row's cut falls inside its first n tokens, because sorting all V entries costs far
    more than a decode step; once n would pass V / 8 the rows are sorted instead.
    """
    vocab = probs.shape[-1]
    filtered = (top_k > 0) | (top_p < 1)
    total = probs.sum(-1, keepdim=True, dtype=torch.float64)
    n = min(vocab, max(64, int(top_k.max())))
    while True:
        if n >= vocab:
            vals, order = probs.sort(dim=-1, descending=True)
        else:
            vals, order = probs.topk(n, dim=-1)  # sorted, descending
        rank = torch.arange(vals.shape[-1], device=probs.device)[None, :]
        keep = (top_k[:, None] <= 0) | (rank < top_k[:, None])
        mass_before = (vals.double().cumsum(dim=-1) - vals.double()) / total
        keep &= (top_p[:, None] >= 1) | (mass_before < top_p[:, None].double())  # 1: off
        if n >= vocab or not bool((keep[:, -1] & filtered).any()):
            break
        n = 16 * n if 16 * n <= vocab // 8 else vocab
    out = torch.zeros_like(probs).scatter_(-1, order, vals.masked_fill(~keep, 0.0))
    return torch.where(filtered[:, None], out, probs)
