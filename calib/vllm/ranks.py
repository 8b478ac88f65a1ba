"""Engines larger than one process: which rank records, and how every rank takes the same serving decision.

Under tensor parallelism (``tensor_parallel_size=N``, N worker processes) every rank of a vLLM V1 engine runs
the whole step: it samples, drafts, and calls ``take_draft_token_ids``; only the output rank's drafts reach the
scheduler (``MultiprocExecutor.output_rank``: TP rank 0 of the last pipeline stage), but every rank drafts its
next passes and rejection-samples with its own copy of calib's state. So:

- **Capture** records on the output rank only: every rank sees every round, and a bank must hold it once
  (:func:`records_here`).
- **Serving** is *computed identically from identical inputs* on every rank, not decided once and shared.
  The decision is a pure function of what every rank holds alike: all-gathered logits (so the drafter's
  confidences), the sampled tokens (vLLM's own invariant: every rank samples the same tokens from the same
  seed), the requests' tokens, the tables, and the online correction learnt from those tokens; nothing is
  read from a clock. Broadcasting the decision instead would ship the drafts, the draft probabilities and
  the online state's inputs every step, and the other ranks still need all of them for their own rejection
  sampler. What identical inputs cannot rule out (a rank whose tables failed to load, an exception on one
  rank, a kernel that differs) is *checked*: at each hook that changes what the engine computes (the number
  of draft passes before drafting, the drafts at ``take_draft_token_ids``) the ranks all-reduce a digest
  of their choice (:class:`RankCheck`, one ``MAX`` over ``[d, -d]`` on the tensor-parallel group's CPU
  group). Every rank sees the same result, so on a disagreement every rank keeps vLLM's own choice for
  that step and switches calib off for the run, in lockstep; a rank that raised takes part with
  :data:`FAILED`, so an exception is a disagreement, never a hang.
- **Pipeline parallelism**: only the last stage samples and drafts; calib's serving hooks are not checked
  across stages, so serving is OFF (the engine line says so) and capture records on the output rank.
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Sequence

log = logging.getLogger("calib.serve")

FAILED = -1  # the digest of a rank whose hook raised: never a real digest (those are crc32 values, >= 0)


def output_rank(parallel_config) -> int:
    """The rank whose outputs vLLM's executor returns: TP rank 0 of the last pipeline stage
    (``MultiprocExecutor._get_output_rank``)."""
    tp = int(getattr(parallel_config, "tensor_parallel_size", 1) or 1)
    pcp = int(getattr(parallel_config, "prefill_context_parallel_size", 1) or 1)
    return int(getattr(parallel_config, "world_size", tp) or tp) - tp * pcp


def records_here(parallel_config, rank: int) -> bool:
    """Whether this worker's capture records: the output rank only (each round once)."""
    return int(rank) == output_rank(parallel_config)


def digest(drafts: Sequence[Sequence[int]] | None) -> int:
    """A digest of a step's draft lists (None: vLLM kept its own), the same in every process (crc32,
    not Python's salted ``hash``)."""
    if drafts is None:
        return zlib.crc32(b"vllm")
    text = ";".join(",".join(str(int(t)) for t in row) for row in drafts)
    return zlib.crc32(text.encode())


class RankCheck:
    """Agreement of the tensor-parallel ranks on one choice per hook (module docstring).

    ``group``: a ``torch.distributed`` process group (tests); None resolves vLLM's tensor-parallel group's CPU
    group at the first check (the workers' distributed state does not exist yet when the plugin starts).
    """

    def __init__(self, group=None):
        self.group = group
        self.world_size: int | None = None
        self.checks = 0  # all-reduces taken part in
        self.disagreements = 0
        self.checked = False  # this hook's check has run (the caller resets it before the hook)

    def _resolve(self) -> None:
        if self.world_size is not None:
            return
        import torch.distributed as dist

        if self.group is None:
            from vllm.distributed.parallel_state import get_tp_group

            tp = get_tp_group()
            self.group, self.world_size = tp.cpu_group, int(tp.world_size)
        else:
            self.world_size = int(dist.get_world_size(self.group))

    def agree(self, value: int) -> bool:
        """Whether every rank passed the same ``value`` (a collective: every rank must call it at the same hook)."""
        import torch
        import torch.distributed as dist

        self.checked = True
        self._resolve()
        if self.world_size <= 1:
            return True
        both = torch.tensor([int(value), -int(value)], dtype=torch.int64)
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self.group)
        self.checks += 1
        same = int(both[0]) == -int(both[1])
        self.disagreements += not same
        return same
