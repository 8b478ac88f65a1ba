"""Shape-aware price mode: each verified draft position priced by the request it extends and its depth.

A flat curve ``cost[T]`` prices a step by its total positions only. A mixture-of-experts target reads
fewer distinct experts when positions are stacked in one sequence than when they are spread over
sequences (consecutive tokens co-activate experts), so its step cost depends on the *shape*. The
shape price is separable over requests:

    cost(depth) = base + sum_i table[i, depth_i]

``base`` = the step with every request verifying its bonus position only; ``table[i, d]`` = what
request ``i`` verifying ``d`` draft tokens adds (``table[:, 0] = 0``; ``+inf`` = a depth it cannot
verify). ``table`` may be ``[W + 1]``, the same for every request. :mod:`calib.cost.moe` builds it
(``MoECost.tangent_price``) from a distinct-expert model, as the tangent of the expert-read count at a
reference shape; a flat curve affine in ``T`` is the special case ``table[i, d] = slope * d``
(:meth:`ShapePrice.affine`).

The rule maximises the expected goodput ``(B + sum_i G_i(d_i)) / cost(depth)`` exactly, for ANY per-request
tables (no concavity needed in the gains or the prices): Dinkelbach's parametric method. At a ratio
``lam`` the problem ``max N(d) - lam * C(d)`` splits into one problem per request, ``max_d G_i(d) - lam *
table[i, d]`` over the request's W + 1 prefixes of each chain (enumerated: no greedy, so a price that
falls with depth, as an MoE's does, is fine); its argmax ``d'`` has ratio ``lam' = N(d') / C(d') >= lam``,
with equality only when ``lam`` is the optimum (then ``max N - lam C = 0``). Start at ``lam`` = no
drafts, iterate until the ratio stops rising (at most :data:`MAX_ITERS` rounds; it converges in a few).
With two chains each request's options are both chains' prefixes: exact there too. What needs the
separable form: a price where one request's cost depends on another's depth (the exact expert-read
count does) has no per-request split; its tangent does (docs/moe.md).

Fixed point, as the flat rule: gains ``q`` on the ``2**-24`` grid (:data:`SCALE`), prices on a grid of
``base / 2**30`` (:data:`PRICE_SCALE`), both summed exactly in int64, each ratio one float64 division;
per-request scores ``G - lam * P`` are one float64 product and one subtraction, so the Triton kernel
(:mod:`calib.allocate.shape_triton`) takes the same decisions bit for bit. Ties: fewer tokens, then the
first chain.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from calib.allocate.reference import SCALE, _pad, survival
from calib.chains import NO_CHAIN

PRICE_SCALE = 1 << 30  # price units per `base`: base is 2**30 exactly
MAX_PRICE_RATIO = 1 << 12  # table / base at most this: int64 sums of B * 2**42 stay below 2**53
MAX_ITERS = 32  # Dinkelbach rounds (both implementations stop at the same one)


@dataclass(frozen=True)
class ShapePrice:
    """A separable verify-step price: ``cost(depth) = base + sum_i table[i, depth_i]``.

    Attributes:
        base: float; the step with every request verifying its bonus position only (> 0, finite).
        table: float ``[B, W + 1]`` or ``[W + 1]`` (every request alike); ``table[..., d]`` = what a
            request verifying ``d`` draft tokens adds; column 0 is 0; ``+inf`` = that depth is not allowed.
    """

    base: float
    table: torch.Tensor

    @staticmethod
    def affine(c_b: float, per_position: float, width: int) -> ShapePrice:
        """The flat curve ``C(T) = c_b + per_position * (T - B)`` as a shape price (a dense target)."""
        return ShapePrice(float(c_b), per_position * torch.arange(width + 1, dtype=torch.float64))

    def cost(self, depth: torch.Tensor) -> torch.Tensor:
        """float64 [] cost of the step verifying ``depth`` int [B] draft tokens per request."""
        table = self.rows(depth.shape[0])
        return self.base + table.gather(1, depth.long().view(-1, 1)).sum()

    def rows(self, n_requests: int) -> torch.Tensor:
        t = self.table.to(torch.float64)
        return t.expand(n_requests, -1) if t.ndim == 1 else t


def check_price(price: ShapePrice, n_requests: int) -> None:
    """Refuse a shape price the rule cannot use, naming the entry and why (reads it on the host)."""
    if not isinstance(price, ShapePrice):
        raise TypeError(f"`price` must be a calib.allocate.ShapePrice, got {type(price).__name__}")
    base, t = price.base, price.table
    if not (isinstance(base, float | int) and math.isfinite(base) and base > 0):
        raise ValueError(f"ShapePrice.base = {base!r}: the step with every request at its bonus position must "
                         "have a finite positive cost")
    if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.ndim not in (1, 2) or t.shape[-1] < 1:
        raise ValueError("ShapePrice.table must be a float tensor [W + 1] or [B, W + 1], got "
                         f"{type(t).__name__}{tuple(getattr(t, 'shape', ()))}")
    if t.ndim == 2 and t.shape[0] != n_requests:
        raise ValueError(f"ShapePrice.table has {t.shape[0]} rows but the batch has B={n_requests} requests")
    t = t.detach().to(torch.float64).cpu()
    if bool((t[..., 0] != 0).any()):
        raise ValueError(f"ShapePrice.table[..., 0] = {t[..., 0].flatten()[:4].tolist()}: column 0 (no draft "
                         "token) must be 0; the bonus positions are in `base`")
    bad = torch.isnan(t) | (t < 0) | (torch.isfinite(t) & (t > MAX_PRICE_RATIO * base))
    if bool(bad.any()):
        at = tuple(int(v) for v in bad.nonzero()[0])
        raise ValueError(f"ShapePrice.table{list(at)} = {float(t[at])!r}: every entry must be >= 0 and at most "
                         f"{MAX_PRICE_RATIO} * base ({MAX_PRICE_RATIO * base:.4g}) or +inf (a depth not allowed)")


def quantized(price: ShapePrice, n_requests: int, width: int, device) -> torch.Tensor:
    """int64 ``[B, W + 1]`` prices on the ``base / 2**30`` grid (``base`` = :data:`PRICE_SCALE`), padded
    with -1 (infeasible) beyond the table's width and where an entry is +inf."""
    t = price.rows(n_requests).to(device)
    out = torch.full((n_requests, width + 1), -1, dtype=torch.int64, device=device)
    cols = min(width + 1, t.shape[1])
    scaled = torch.round(t[:, :cols] * (PRICE_SCALE / float(price.base)))
    out[:, :cols] = torch.where(torch.isfinite(scaled), scaled, -1.0).to(torch.int64)
    return out


def dinkelbach(q: torch.Tensor, price_q: torch.Tensor, n_requests: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact separable ratio rule on gains ``q`` int32 ``[C, B, W]`` (C chains, rows non-increasing) and
    quantized prices ``price_q`` int64 ``[B, W + 1]`` (-1 = infeasible): ``(chain index [B], depth [B])``."""
    C, B, W = q.shape
    gained = q.to(torch.int64).cumsum(dim=2)  # [C, B, W]: G at depth d = 1..W
    prices = price_q[None, :, 1:].expand(C, B, W)
    feasible = (q > 0) & (prices >= 0)
    g64, p64 = gained.to(torch.float64), prices.to(torch.float64)
    cols = torch.arange(1, W + 1, device=q.device)
    rows = torch.arange(B, device=q.device)
    base_n = n_requests * SCALE
    choice = torch.zeros(B, dtype=torch.int64, device=q.device)
    depth = torch.zeros(B, dtype=torch.int64, device=q.device)
    lam = torch.tensor(float(base_n), dtype=torch.float64) / float(PRICE_SCALE)
    for _ in range(MAX_ITERS):
        score = torch.where(feasible, g64 - lam * p64, -torch.inf)
        best = score.amax(dim=2)  # [C, B]
        d = torch.where(score == best[..., None], cols, W + 1).amin(dim=2)
        d = torch.where(best > 0, d, 0)  # ties with verifying nothing: fewer tokens
        surplus = best.clamp(min=0)
        take = (surplus[1] > surplus[0]) | ((surplus[1] == surplus[0]) & (d[1] < d[0])) if C > 1 else d[0] < 0
        new_choice = take.to(torch.int64)
        new_depth = d.gather(0, new_choice[None]).squeeze(0)
        at = (new_depth - 1).clamp(min=0)
        num = base_n + torch.where(new_depth > 0, gained[new_choice, rows, at], 0).sum()
        den = PRICE_SCALE + price_q[rows, new_depth].sum()
        lam_new = num.to(torch.float64) / den.to(torch.float64)
        if not bool(lam_new > lam):
            break
        choice, depth, lam = new_choice, new_depth, lam_new
    return choice, depth


def allocate_shape_reference(first_p: torch.Tensor, second_p: torch.Tensor | None, price: ShapePrice,
                             ids: tuple[int, int] = (1, 2)) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(drafter int8 [B], depth int32 [B], expected_accepted float32 [B])`` under the shape price
    (checked by the caller: :func:`check_price`)."""
    device = first_p.device
    B = first_p.shape[0]
    width = max(first_p.shape[1], 0 if second_p is None else second_p.shape[1], 1)
    stacked = [_pad(first_p, width)] + ([] if second_p is None else [_pad(second_p.to(device), width)])
    surv, q = survival(torch.cat(stacked))
    C = len(stacked)
    choice, depth = dinkelbach(q.view(C, B, width), quantized(price, B, width, device), B)
    surv = surv.view(C, B, width)[choice, torch.arange(B, device=device)]
    cols = torch.arange(width, device=device)
    expected = surv.masked_fill(cols >= depth[:, None], 0.0).sum(dim=1)
    drafter = torch.where(depth > 0, torch.where(choice > 0, ids[1], ids[0]), NO_CHAIN).to(torch.int8)
    return drafter, depth.to(torch.int32), expected
