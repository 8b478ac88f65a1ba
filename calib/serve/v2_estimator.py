"""calib tables as the acceptance estimator of vLLM 0.32's Model Runner V2 (GPU, async scheduling):
:class:`CalibAcceptanceEstimator` answers V2's adaptive verification with calibrated tables, and
:func:`install` puts it in place (untested on a GPU engine). Design, limits and install: docs/v2_estimator.md.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from calib.allocate.triton_kernels import chain_column, check_runnable, interpreting
from calib.chains import CONTEXT, confidence_chain
from calib.tables.layout import ChainTable, chain_lookup

HISTORY_AXES = ("prev_accept", "mean_accept", "position")  # calib.labels.HISTORY_COLUMNS (not imported:
#                                                            calib.labels needs pyarrow)
IMPLS = ("triton", "reference")
_BLOCK = 128  # draft rows per program of the lookup kernel
_NO_DEPTH_LIMIT = 1 << 30  # chain_column's "k < L" mask: every depth is present here


@triton.jit
def _predict_lookup_kernel(
    x_ptr, x_stride_b, x_stride_a,
    idx_ptr, step_ptr, out_ptr, out_stride, num_rows, no_depth_limit,
    grid_ptr, D, C, G, edges_ptr, strides_ptr, A_BINS, E,
    PER_ROW_STEP: tl.constexpr, NUM_STEPS: tl.constexpr, INTERP: tl.constexpr, BLOCK: tl.constexpr,
):
    """One program per BLOCK draft rows: calib's table lookup at each row's depth, written to
    ``out[batch, step]`` for live rows (``idx >= 0``)."""
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_range = rows < num_rows
    req = tl.load(idx_ptr + rows, mask=in_range, other=-1)
    live = in_range & (req >= 0)  # cudagraph-padded rows carry -1: never written
    if PER_ROW_STEP:  # parallel drafting: request = row // K, step per row
        step = tl.load(step_ptr + rows, mask=in_range, other=0).to(tl.int64)
        batch = rows // NUM_STEPS
    else:  # one step, one row per request
        step = tl.load(step_ptr).to(tl.int64)
        batch = rows
    # calib's lookup at column `step` of a [rows, 1, A] input (stride_l = 0): table row
    # min(step, D - 1), the context cell from the binned axes, conf interpolated.
    p = chain_column(x_ptr, x_stride_b, 0, x_stride_a, step, rows, live, no_depth_limit,
                      grid_ptr, D, C, G, edges_ptr, strides_ptr, A_BINS, E,
                      True, INTERP, BLOCK)
    p = tl.where(p == p, p, 0.0)  # noqa: PLR0124 -- NaN (no token) -> nothing survives
    tl.store(out_ptr + batch * out_stride + step, p, mask=live)


class CalibAcceptanceEstimator:
    """Calibrated per-depth acceptance for V2 adaptive verification (see the module docstring).

    Args:
        tables: calib tables (:class:`calib.tables.Tables` or any ``AcceptanceTables`` with a
            ``"model"`` :class:`~calib.tables.layout.ChainTable`): axes ``conf`` (interpolated), then
            context axes among ``temperature``, ``prev_accept``, ``mean_accept``, ``position``.
        max_num_reqs: the speculator's ``max_num_reqs`` (request-state slots).
        num_speculative_steps: K. Refused if deeper than the table's rows unless the tables say
            ``reuse_last_row``.
        device: where the buffers live (the speculator's device).
        impl: ``"triton"`` (graph-capturable; default on CUDA) or ``"reference"`` (torch
            ``chain_lookup``, host-side checks; default elsewhere).
    """

    def __init__(self, tables, max_num_reqs: int, num_speculative_steps: int, device: torch.device | str,
                 *, impl: str | None = None, chain: str | None = None):
        chain = confidence_chain() if chain is None else chain  # default: the model drafter's chain
        chains = getattr(tables, "chains", None)
        if not isinstance(chains, dict) or chain not in chains:
            raise ValueError(f"the tables calibrate {sorted(chains or {})}, not the {chain!r} chain the V2 "
                             "estimator reads (it scores the model drafter's own distribution)")
        table: ChainTable = chains[chain]
        names = [a.name for a in table.axes]
        if names[0] != "conf" or not table.interpolated:
            raise ValueError(f"the {chain} chain's table reads {names}; the V2 estimator passes the drafter's "
                             "confidence (max q, interpolated axis 'conf') first")
        ctx = names[1:]
        unknown = [n for n in ctx if n not in CONTEXT]
        if unknown:
            raise ValueError(f"the {chain} chain's table reads {unknown} after 'conf'; the V2 estimator knows "
                             f"only the context axes {sorted(CONTEXT)}")
        reuse = bool(getattr(tables, "reuse_last_row", False))
        if num_speculative_steps > table.depths and not reuse:
            raise ValueError(f"num_speculative_steps={num_speculative_steps} but the tables' {chain}.grid holds "
                             f"depths 0..{table.depths - 1} only (D={table.depths}); use tables fitted that deep "
                             "or tables with reuse_last_row=True")
        if impl is None:
            impl = "triton" if torch.device(device).type == "cuda" else "reference"
        if impl not in IMPLS:
            raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
        self.impl = impl
        self.chain = chain
        self.context_names = tuple(ctx)
        self.max_num_reqs = int(max_num_reqs)
        self.num_speculative_steps = int(num_speculative_steps)
        self.device = torch.device(device)
        self.table = table.to(self.device)
        dev = self.device
        # Kernel arguments of the table, made once (contiguous, on the device).
        self._grid = self.table.grid.to(torch.float32).contiguous()  # [D, C]
        n_bins = self.table.edges.shape[0]
        self._n_bins = n_bins
        self._n_edges = self.table.edges.shape[1] if n_bins else 0
        if n_bins:
            self._edges = self.table.edges.to(torch.float32).contiguous()  # [A_b, E]
            self._strides = self.table.strides.to(torch.int64).contiguous()  # [A_b]
        else:  # never read, but the pointers must be valid
            self._edges = torch.zeros(1, dtype=torch.float32, device=dev)  # [1]
            self._strides = torch.zeros(1, dtype=torch.int64, device=dev)  # [1]

        # Per request-state slot, plus one scratch slot (index max_num_reqs) that padded rows
        # (idx_mapping == -1) read from and write to, so every scatter has unique live indices.
        n = self.max_num_reqs + 1
        self.rounds = torch.zeros(n, dtype=torch.float32, device=dev)  # [max_num_reqs + 1]: rounds seen
        self.accepted_total = torch.zeros(n, dtype=torch.float32, device=dev)  # [max_num_reqs + 1]: accepted over them
        self.last_accept = torch.zeros(n, dtype=torch.float32, device=dev)  # [max_num_reqs + 1]: latest round's accepted
        # The history context axes before each slot's next round, in HISTORY_AXES order (NaN in a
        # request's first round for prev_accept / mean_accept, as RequestHistory).
        self.history = torch.full((n, len(HISTORY_AXES)), math.nan, dtype=torch.float32, device=dev)  # [max_num_reqs + 1, 3]
        self.history[:, 2] = 0.0
        # Column of each context axis in [temperature, *HISTORY_AXES] (what predict gathers).
        order = ("temperature", *HISTORY_AXES)
        self._ctx_cols = torch.tensor([order.index(c) for c in ctx], dtype=torch.int64, device=dev)  # [A_ctx]

    # -- the OnlineAcceptanceEstimator interface ----------------------------------------------------
    def step(
        self,
        idx_mapping: torch.Tensor,
        num_sampled: torch.Tensor,
        num_rejected: torch.Tensor,
    ) -> None:
        """Fold the last verdict into the history buffers: per batch row, accepted = ``num_sampled - 1``
        (the bonus token off; 0 for a chunked prefill), admitted drafts = accepted + ``num_rejected``;
        a row with at least one admitted draft is a round (``RequestHistory.observe``), others change
        nothing. Device ops only."""
        # idx_mapping: [num_reqs] int (req_state_idx, -1 = padded); num_sampled, num_rejected: [num_reqs] int
        num_reqs = idx_mapping.shape[0]
        idx = idx_mapping.to(torch.int64)  # [num_reqs]
        slot = torch.where(idx >= 0, idx, self.max_num_reqs)  # [num_reqs]: padded -> scratch slot
        accepted = (num_sampled[:num_reqs].to(torch.int64) - 1).clamp(min=0)  # [num_reqs]
        drafted = accepted + num_rejected[:num_reqs].to(torch.int64)  # [num_reqs]
        is_round = (idx >= 0) & (drafted > 0)  # [num_reqs]
        acc = accepted.to(torch.float32)  # [num_reqs]
        rounds = self.rounds[slot] + is_round.to(torch.float32)  # [num_reqs]
        total = self.accepted_total[slot] + torch.where(is_round, acc, 0.0)  # [num_reqs]
        last = torch.where(is_round, acc, self.last_accept[slot])  # [num_reqs]
        self.rounds[slot] = rounds
        self.accepted_total[slot] = total
        self.last_accept[slot] = last
        seen = rounds > 0  # [num_reqs]
        # mean in float64 then float32, the rounding decide_step's float64 context gets.
        mean = (total.to(torch.float64) / rounds.to(torch.float64).clamp(min=1.0)).to(torch.float32)  # [num_reqs]
        hist = torch.stack([torch.where(seen, last, math.nan), torch.where(seen, mean, math.nan),
                            total + rounds], dim=1)  # [num_reqs, 3]
        self.history[slot] = hist

    def predict(
        self,
        logits: torch.Tensor,
        idx_mapping: torch.Tensor,
        draft_step: torch.Tensor,
        confidence_probs: torch.Tensor,
        temperature: torch.Tensor,
    ) -> None:
        """Write ``confidence_probs[batch_idx, step]`` = calibrated P(accept at ``step`` | reached) for
        every live row of ``logits``; ``batch_idx`` = row (0-d ``draft_step``) or row // K (per-row
        ``draft_step``, parallel drafting). Other entries are left as they are."""
        # logits: [num_tokens, V] (pre-temperature draft logits); idx_mapping: [num_tokens] int
        # (req_state_idx, -1 = padded); draft_step: [] or [num_tokens] int; confidence_probs:
        # [max_num_reqs, K] float32 (written in place); temperature: [max_num_reqs] float (per slot)
        x = self.inputs(logits, idx_mapping, temperature)  # [num_tokens, A]
        if self.impl == "triton":
            self._predict_triton(x, idx_mapping, draft_step, confidence_probs)
        else:
            self._predict_reference(x, idx_mapping, draft_step, confidence_probs)

    # -- helpers ---------------------------------------------------------------------------------
    def add_request(self, req_idx: int) -> None:
        """A new request takes slot ``req_idx``: its history starts afresh (first round)."""
        self.rounds[req_idx] = 0.0
        self.accepted_total[req_idx] = 0.0
        self.last_accept[req_idx] = 0.0
        self.history[req_idx, :2] = math.nan
        self.history[req_idx, 2] = 0.0

    def inputs(self, logits: torch.Tensor, idx_mapping: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
        """The table inputs per draft row, float32 ``[num_tokens, A]``: ``max q`` of the row's
        temperature-scaled distribution, then the context axes in the tables' order."""
        idx = idx_mapping.to(torch.int64)  # [num_tokens]
        slot = torch.where(idx >= 0, idx, self.max_num_reqs)  # [num_tokens]
        temp = temperature.to(torch.float32)[idx.clamp(min=0)]  # [num_tokens]
        scale = torch.where(temp > 0, temp, 1.0)  # [num_tokens]: 0 = greedy, logits unscaled
        scaled = logits.to(torch.float32) / scale[:, None]  # [num_tokens, V]
        max_q = torch.exp(scaled.amax(dim=1) - torch.logsumexp(scaled, dim=1)).clamp(0.0, 1.0)  # [num_tokens]
        known = torch.cat([temp[:, None], self.history[slot]], dim=1)  # [num_tokens, 4]
        ctx = known.index_select(1, self._ctx_cols)  # [num_tokens, A_ctx]
        return torch.cat([max_q[:, None], ctx], dim=1).contiguous()  # [num_tokens, A]

    def _predict_triton(self, x, idx_mapping, draft_step, confidence_probs) -> None:
        check_runnable(x.device)
        num_rows = x.shape[0]
        launch = {} if interpreting() else {"enable_fp_fusion": False, "num_warps": 4}
        _predict_lookup_kernel[(max(1, -(-num_rows // _BLOCK)),)](
            x, x.stride(0), x.stride(1),
            idx_mapping, draft_step, confidence_probs, confidence_probs.stride(0), num_rows, _NO_DEPTH_LIMIT,
            self._grid, self._grid.shape[0], self._grid.shape[1], max(self.table.points, 1),
            self._edges, self._strides, self._n_bins, self._n_edges,
            PER_ROW_STEP=draft_step.dim() > 0, NUM_STEPS=self.num_speculative_steps, INTERP=True, BLOCK=_BLOCK,
            **launch,
        )

    def _predict_reference(self, x, idx_mapping, draft_step, confidence_probs) -> None:
        """``chain_lookup`` on a ``[rows, K, A]`` input holding each row's features at its depth
        (NaN elsewhere); host-side checks and boolean indexing: not for a captured graph."""
        num_rows, n_axes = x.shape
        rows = torch.arange(num_rows, device=x.device)  # [num_tokens]
        per_row = draft_step.dim() > 0
        step = (draft_step.to(torch.int64) if per_row else draft_step.to(torch.int64).expand(num_rows))  # [num_tokens]
        batch = rows // self.num_speculative_steps if per_row else rows  # [num_tokens]
        full = torch.full((num_rows, self.num_speculative_steps, n_axes), math.nan, dtype=torch.float32,
                          device=x.device)  # [num_tokens, K, A]
        full[rows, step] = x
        p = chain_lookup(self.table, full, self.chain).gather(1, step[:, None]).squeeze(1)  # [num_tokens]
        p = torch.nan_to_num(p, nan=0.0)
        live = idx_mapping.to(torch.int64) >= 0  # [num_tokens]
        confidence_probs[batch[live], step[live]] = p[live].to(confidence_probs.dtype)


def install(speculator, tables_dir, *, adaptive_verification=None, impl: str | None = None,
            chain: str | None = None) -> CalibAcceptanceEstimator:
    """Replace a V2 ``DraftModelSpeculator``'s acceptance estimator by calib's tables (UNTESTED on a real
    GPU engine: vLLM is not on the GPU machine calib was developed with).

    Call after ``speculator.load_model`` with adaptive verification on (the speculator then holds an
    ``OnlineAcceptanceEstimator``); pass the runner's ``adaptive_verification`` manager so that a slot
    taken by a new request starts its history afresh (its ``add_request`` is wrapped). Tables are
    loaded and verified with :func:`calib.tables.load`; check them against the engine's model and
    drafter (``Tables.check_bank``) before serving. Returns the installed estimator.
    """
    if getattr(speculator, "acceptance_estimator", None) is None:
        raise RuntimeError("the speculator has no acceptance estimator: V2 builds one only with "
                           "speculative_config.enable_adaptive_verification=True, after load_model")
    from calib.tables.io import load

    tables = load(tables_dir)
    est = CalibAcceptanceEstimator(tables, speculator.max_num_reqs, speculator.num_speculative_steps,
                                   speculator.device, impl=impl, chain=chain)
    speculator.acceptance_estimator = est
    if adaptive_verification is not None:
        orig_add = adaptive_verification.add_request

        def add_request(req_idx: int) -> None:
            orig_add(req_idx)
            est.add_request(req_idx)

        adaptive_verification.add_request = add_request
    return est
