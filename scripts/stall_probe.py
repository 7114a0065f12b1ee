"""Where the policy gradient of a tiny_cpu run pushes each symbol, step by step (a diagnosis probe).

    python scripts/stall_probe.py --out /tmp/diag/p23.jsonl -- --config tiny_cpu seed=23 \
        output_dir=/tmp/diag/p23 overwrite_output_dir=true progress_bar=false checkpoint.export_hf=false

Runs the async_ppo recipe unchanged, with read-only hooks around it (docs/learning-stalls-diagnosis.md
says what they found). The hooks only add forwards and gradients of their own (``torch.autograd.grad``:
the parameters' ``.grad`` and the optimizer are untouched) and use no random numbers, so the run's
rewards are those of the same seed without the probe (compare ``rollout/reward_mean``).

For each of the first ``--grad-steps`` steps, per optimizer step (minibatch), one JSON line with:

* ``Q``: for each symbol s of the alphabet, Q_s = mean log p(s) over the teacher-forced answer
  positions whose target is s (all |alphabet|^length copy strings), before and after the step.
* ``terms``: the gradient of the policy loss split by token cell x advantage component, projected
  on ∇Q_s. Cells: (target symbol T, sampled token S), S = a symbol or "x" (any other token).
  Components of the whitened advantage Â = (A − μ)/σ, A = GAE: ``own`` (λ^(L−1−t)·[token right]/L,
  the token's own share of the sequence reward), ``oth`` (λ^(L−1−t)·the other positions' share),
  ``crit`` (the critic's part of GAE), ``mean`` (−μ/σ, the whitening shift). For each
  (s, cell, component): ``sgd`` = <∇Q_s, −G> and ``adam`` = <∇Q_s, −lr·c·G/(sqrt(v̂')+ε)> (c: the
  grad-norm clip factor, v̂': Adam's bias-corrected second moment after this gradient; the eventual
  change of Q_s this gradient causes through the momentum, to first order), each split by
  parameters: ``row`` (the tied embedding/unembedding row of s), ``emb`` (the other rows), ``body``.
* ``check``: the relative error between the sum of the split gradients and the real ``.grad``.

On every step (cheap): the tokens behind a large ``train/approx_kl`` (the k3 terms of a minibatch
whose mean is over ``--kl-threshold``) with their advantage, anchor/current/behaviour logprobs,
target and position, and the Adam state of their embedding rows (``kl`` lines), and per optimizer
step the embedding row that moved most (``step`` lines).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from minippo import models, rl
from minippo.config._parse import parse_recipe_args
from minippo.models.fused_policy_loss import _agg_coef
from minippo.models.tokenizer import TinyTokenizer


def _load_recipe():
    """recipes/async_ppo.py as a module (recipes/ is scripts, not a package)."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "recipes" / "async_ppo.py"
    spec = importlib.util.spec_from_file_location("async_ppo_probed", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


recipe = _load_recipe()

COMPS = ("own", "oth", "crit", "mean")


class Probe:
    def __init__(self, out: Path, grad_steps: int, kl_threshold: float, alphabet: str, length: int):
        self.out = out.open("w")
        self.grad_steps, self.kl_threshold = grad_steps, kl_threshold
        tok = TinyTokenizer()
        self.sym = torch.tensor(tok.encode(alphabet))  # token ids of the symbols
        self.names = [*alphabet, "x"]
        self.length = length
        strings = torch.tensor(list(itertools.product(self.sym.tolist(), repeat=length)))
        bos, eq = tok.bos_id, tok.encode("=")[0]
        n = strings.shape[0]
        self.probe_ids = torch.cat(
            [torch.full((n, 1), bos), strings, torch.full((n, 1), eq), strings], dim=1
        )
        self.step = -1
        self.mb = 0
        self.G: dict[tuple[int, int, str], torch.Tensor] = {}
        self.kl_rows: list[dict] = []
        self.save_dir, self.save_steps = None, (0, -1)

    def write(self, rec: dict) -> None:
        self.out.write(json.dumps(rec) + "\n")
        self.out.flush()

    # ---- helpers ---------------------------------------------------------------------------
    def symbol_index(self, ids: torch.Tensor) -> torch.Tensor:
        """0..|alphabet|-1 for a symbol's id, |alphabet| for any other token."""
        idx = torch.full_like(ids, len(self.sym))
        for i, s in enumerate(self.sym.tolist()):
            idx[ids == s] = i
        return idx

    def q_values(self, actor, grad: bool):
        """Q_s = mean log p(s | teacher-forced, target s), per symbol; (Q [S], graph-or-None)."""
        ids = self.probe_ids
        pos = torch.arange(ids.shape[1]).expand_as(ids)
        with torch.set_grad_enabled(grad):
            logits = actor(ids, position_ids=pos, attention_mask=torch.ones_like(ids, dtype=bool))
            P = ids.shape[1] - self.length
            lp = torch.log_softmax(logits[:, P - 1 : -1].float(), -1)
            lp = lp.gather(-1, ids[:, P:, None]).squeeze(-1)
            tgt = self.symbol_index(ids[:, P:])
            qs = [lp[tgt == i].mean() for i in range(len(self.sym))]
        return qs

    # ---- hooks -----------------------------------------------------------------------------
    def on_gae(self, orig, values, token_rewards, mask, **kw):
        adv, ret = orig(values, token_rewards, mask, **kw)
        kw0 = {**kw, "bootstrap_values": None if kw.get("bootstrap_values") is None
               else torch.zeros_like(kw["bootstrap_values"])}  # fmt: skip
        zeros = torch.zeros_like(values)
        self.A_R = orig(zeros, token_rewards, mask, **kw0)[0]  # the rewards' part of GAE
        ones = rl.place_sequence_rewards(torch.ones(mask.shape[0]), mask)
        self.k = orig(zeros, ones, mask, **kw0)[0]  # λ^(L−1−t)
        self.A_V = adv - self.A_R  # the critic's part
        self.A = adv
        return adv, ret

    def on_updates(self, rec, orig, step, plan, batch, corr, advantages, *rest):
        self.step, self.mb = step, 0
        self.batch, self.adv = batch, advantages
        m = batch.response_mask
        P = batch.prompt_len
        R = m.shape[1]
        self.target = batch.input_ids[:, 1 : 1 + R]  # copy task: answer = prompt symbols
        self.sampled = batch.input_ids[:, P:]
        right = (self.sampled == self.target).float() * m
        valid = m > 0
        A = self.A
        mu = A[valid].mean()
        sigma = torch.sqrt(A[valid].var() + 1e-8)
        own = self.k * right / self.length
        comps = {
            "own": own / sigma,
            "oth": (self.A_R - own) / sigma,
            "crit": self.A_V / sigma,
            "mean": (-mu / sigma).expand_as(A),
        }
        self.comps = {k: torch.where(valid, v, 0.0) for k, v in comps.items()}
        err = (sum(self.comps.values()) - advantages).abs().max().item()
        self.cells_T = self.symbol_index(self.target)
        self.cells_S = self.symbol_index(self.sampled)
        if step < self.grad_steps:
            # per-symbol sample counts in this batch: (target, sampled) table
            tab = torch.zeros(len(self.sym), len(self.sym) + 1)
            for t, s in zip(self.cells_T[valid].tolist(), self.cells_S[valid].tolist()):
                if t < len(self.sym):
                    tab[t, s] += 1
            self.write({"kind": "batch", "step": step, "whiten_check": err, "mu": mu.item(),
                        "sigma": sigma.item(), "counts": tab.tolist(),
                        "reward": batch.rewards.mean().item()})  # fmt: skip
        return orig(rec, step, plan, batch, corr, advantages, *rest)

    def on_actor_backward(self, orig, rec, mb, rows, *args):
        self.rows = rows
        return orig(rec, mb, rows, *args)

    def on_fused(self, orig, model, input_ids, spec, **score):
        rows = self.rows
        with torch.no_grad():
            lp0 = models.token_logprobs(model, input_ids, **score)
        m = spec.response_mask
        valid = m > 0
        kept = valid if spec.keep_mask is None else valid & (spec.keep_mask > 0)
        anchor = spec.anchor_logprobs
        d = torch.where(kept, (anchor - lp0).clamp(-20, 20), 0.0)
        k3 = torch.where(kept, torch.expm1(d) - d, 0.0)
        kl = (k3.sum() / kept.sum().clamp(min=1)).item()
        if kl > self.kl_threshold:
            flat = torch.argsort(k3.reshape(-1), descending=True)[:5]
            R = m.shape[1]
            mu = self.batch.rollout_logprobs[rows]
            for f in flat.tolist():
                b, t = divmod(f, R)
                tokid = int(input_ids[b, input_ids.shape[1] - R + t])
                self.kl_rows.append({
                    "kind": "kl", "step": self.step, "mb": self.mb, "kl_mb": kl,
                    "k3": k3[b, t].item(), "d": d[b, t].item(), "lp": lp0[b, t].item(),
                    "anchor": anchor[b, t].item(), "mu": mu[b, t].item(),
                    "adv": spec.advantages[b, t].item(), "token": tokid,
                    "target": int(self.target[rows][b, t]), "pos": t,
                    "reward": self.batch.rewards[rows][b].item(),
                    "version": int(self.batch.versions[rows][b, t]),
                    "kl_share": (k3[b, t] / k3.sum()).item(),
                })  # fmt: skip
        if self.step < self.grad_steps:
            self.category_grads(model, input_ids, spec, score, rows, kept)
        return orig(model, input_ids, spec, **score)

    def category_grads(self, model, input_ids, spec, score, rows, kept):
        params = [p for p in model.parameters()]
        lp = models.token_logprobs(model, input_ids, **{**score, "packed": None})
        m = spec.response_mask
        coef = _agg_coef(spec, torch.zeros_like(m))
        w = torch.ones_like(m) if spec.weights is None else spec.weights
        A = spec.advantages
        r = torch.exp((lp.detach() - spec.anchor_logprobs).clamp(-20, 20))
        unclipped = torch.where(A > 0, r <= 1 + spec.eps_high, r >= 1 - spec.eps_low)
        mult = torch.where(kept & unclipped, coef * w * r, 0.0)  # ∂loss/∂lp = −mult·Â
        T, S = self.cells_T[rows], self.cells_S[rows]
        outs, keys = [], []
        for t in range(len(self.sym)):
            for s in range(len(self.sym) + 1):
                cell = T.eq(t) & S.eq(s) & kept
                if not cell.any():
                    continue
                for c in COMPS:
                    outs.append(torch.where(cell, -mult * self.comps[c][rows], 0.0))
                    keys.append((t, s, c))
        grads = torch.autograd.grad(lp, params, grad_outputs=torch.stack(outs),
                                    is_grads_batched=True)  # fmt: skip
        flat = torch.cat([g.reshape(len(outs), -1) for g in grads], dim=1)
        for key, g in zip(keys, flat):
            self.G[key] = self.G.get(key, 0) + g

    def on_clip(self, orig, model, optimizer, guard, loss, *, max_norm, step):
        if hasattr(model, "value_head"):
            return orig(model, optimizer, guard, loss, max_norm=max_norm, step=step)
        names = [n for n, _ in model.named_parameters()]
        params = [p for p in model.parameters()]
        emb_i = names.index("tok_embeddings.weight")
        sizes = [p.numel() for p in params]
        off = sum(sizes[:emb_i])
        V, D = params[emb_i].shape
        g = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                       for p in params])  # fmt: skip
        norm = g.norm().item()
        clipf = min(1.0, max_norm / (norm + 1e-6))
        group = optimizer.param_groups[0]
        _, beta2 = group["betas"]
        eps, lr = group["eps"], group["lr"]
        vs, k = [], 1
        for p in params:
            st = optimizer.state.get(p, {})
            vs.append(st["exp_avg_sq"].reshape(-1) if "exp_avg_sq" in st else
                      torch.zeros(p.numel()))  # fmt: skip
            if "step" in st:
                k = int(st["step"]) + 1
        v_old = torch.cat(vs)
        v_new = beta2 * v_old + (1 - beta2) * (clipf * g) ** 2
        denom = (v_new / (1 - beta2**k)).sqrt() + eps
        precond = lr * clipf / denom
        rec = {"kind": "step", "step": self.step, "mb": self.mb, "grad_norm": norm,
               "clip": clipf, "lr": lr}  # fmt: skip
        row_of = lambda tok: slice(off + tok * D, off + (tok + 1) * D)  # noqa: E731
        if self.step < self.grad_steps:
            qs = self.q_values(model, grad=True)
            gq = [torch.cat([x.reshape(-1) for x in torch.autograd.grad(q, params, retain_graph=True)])
                  for q in qs]  # fmt: skip
            Gsum = sum(self.G.values())
            rec["check"] = ((Gsum - g).norm() / g.norm().clamp(min=1e-12)).item()
            rec["Q_before"] = [q.item() for q in qs]
            terms = {}
            for si, tokid in enumerate(self.sym.tolist()):
                rs = row_of(tokid)
                emb = torch.zeros_like(g, dtype=torch.bool)
                emb[off : off + V * D] = True
                emb[rs] = False
                for (t, s, c), G in self.G.items():
                    parts = {}
                    for kind, u in (("sgd", -G), ("adam", -precond * G)):
                        prod = gq[si] * u
                        row = prod[rs].sum().item()
                        e = prod[emb].sum().item()
                        body = prod.sum().item() - row - e
                        parts[kind] = [row, e, body]
                    terms[f"{self.names[si]}|{self.names[t]}{self.names[s]}|{c}"] = parts
            rec["terms"] = terms
            # Adam's step size per unit gradient: row of each symbol vs the rest of the model
            rec["precond_row"] = [precond[row_of(t)].mean().item() for t in self.sym.tolist()]
            rec["precond_body"] = precond[off + V * D :].mean().item() if off == 0 else None
            rec["precond_all"] = precond.mean().item()
        before = torch.cat([p.detach().reshape(-1) for p in params]).clone()
        if self.save_dir is not None and self.save_steps[0] <= self.step <= self.save_steps[1]:
            torch.save({"state": {k: v.detach().clone() for k, v in model.state_dict().items()},
                        "input_ids": self.batch.input_ids, "position_ids": self.batch.position_ids,
                        "attention_mask": self.batch.attention_mask,
                        "rollout_logprobs": self.batch.rollout_logprobs},
                       self.save_dir / f"w{self.step:03d}_{self.mb}.pt")  # fmt: skip
        out = orig(model, optimizer, guard, loss, max_norm=max_norm, step=step)
        after = torch.cat([p.detach().reshape(-1) for p in params])
        delta = (after - before)[off : off + V * D].reshape(V, D)
        rows_norm = delta.norm(dim=1)
        top = int(rows_norm.argmax())
        v_top = v_new[row_of(top)]
        rec.update({"top_row": top, "top_row_delta": rows_norm[top].item(),
                    "top_row_mean_abs_step_over_lr": (delta[top].abs().mean() / lr).item(),
                    "top_row_sqrt_v": v_top.sqrt().mean().item(),
                    "sym_row_delta": [rows_norm[t].item() for t in self.sym.tolist()],
                    "update_norm": (after - before).norm().item()})  # fmt: skip
        if self.step < self.grad_steps:
            with torch.no_grad():
                rec["Q_after"] = [q.item() for q in self.q_values(model, grad=False)]
        for r in self.kl_rows:
            r["adam_row_sqrt_v"] = v_old[row_of(r["token"])].sqrt().mean().item()
            r["row_delta"] = rows_norm[r["token"]].item()
            r["row_mean_abs_step_over_lr"] = (delta[r["token"]].abs().mean() / lr).item()
            self.write(r)
        self.kl_rows = []
        self.write(rec)
        self.G = {}
        self.mb += 1
        return out


def wrap(obj, name, hook, bound=False):
    orig = getattr(obj, name)
    if bound:
        setattr(obj, name, lambda self, *a, **k: hook(orig, self, *a, **k))
    else:
        setattr(obj, name, lambda *a, **k: hook(orig, *a, **k))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--grad-steps", type=int, default=30)
    ap.add_argument("--kl-threshold", type=float, default=1.0)
    ap.add_argument(
        "--save-weights",
        type=Path,
        default=None,
        help="a folder: the actor's weights and batch before each optimizer step",
    )
    ap.add_argument("--save-steps", default="0--1", help="LO-HI: the steps --save-weights covers")
    ap.add_argument("recipe_args", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    args = [x for x in a.recipe_args if x != "--"]
    cfg = parse_recipe_args(args)
    probe = Probe(a.out, a.grad_steps, a.kl_threshold, cfg.dataset.alphabet, cfg.dataset.length)
    if a.save_weights is not None:
        a.save_weights.mkdir(parents=True, exist_ok=True)
        lo, hi = a.save_steps.split("-", 1)
        probe.save_dir, probe.save_steps = a.save_weights, (int(lo), int(hi))
    wrap(rl, "gae", probe.on_gae)
    wrap(models, "fused_policy_loss", probe.on_fused)
    wrap(recipe, "clip_and_step", probe.on_clip)
    cls = recipe.AsyncPPORecipe
    wrap(cls, "_ppo_updates", lambda orig, self, *x: probe.on_updates(self, orig, *x), bound=True)
    wrap(cls, "_actor_backward", lambda orig, self, *x: probe.on_actor_backward(orig, self, *x),
         bound=True)  # fmt: skip
    recipe.recipe_main(cfg)


if __name__ == "__main__":
    main()
