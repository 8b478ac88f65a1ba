"""vLLM plugin entry point (group ``vllm.general_plugins``), loaded in every vLLM process.

It does nothing unless collection is enabled through the environment, so installing calib never
changes a user's engine. The environment is only the carrier: the collector (:mod:`calib.collect.runner`)
writes these variables from its resolved config just before the engine starts (``calib.envs.export``),
because vLLM's worker processes receive nothing else from it; users set none of them by hand.

* ``CALIB_COLLECT_DIR=<dir>``: install the capture hooks (:mod:`calib.collect.hooks`), writing there,
  with the n-gram chain of ``CALIB_NGRAM`` and, for ``routing.capture``, ``CALIB_ROUTING`` /
  ``CALIB_SHADOW_ROUTER``.
* ``CALIB_CPU_SAMPLING_FIX=1`` (set by the collector on CPU builds): replace vLLM 0.32's CPU
  ``expand_batch_to_tokens``, which casts float inputs to int64 and garbles sampled speculative
  decoding at temperature > 0. GPU builds are never touched.
"""

from __future__ import annotations

from calib import envs


def expand_batch_to_tokens(x, cu_num_tokens, num_tokens, replace_from=0, replace_to=0):
    """Same contract as vllm.v1.sample.rejection_sampler.expand_batch_to_tokens, dtype-preserving."""
    import torch

    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1, dtype=torch.long))
    if replace_from != replace_to:
        x = torch.where(x == replace_from, torch.full_like(x, replace_to), x)
    return torch.repeat_interleave(x, counts, output_size=num_tokens)


def apply_cpu_sampling_fix() -> bool:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    import vllm.v1.sample.rejection_sampler as rs

    rs.expand_batch_to_tokens = expand_batch_to_tokens
    return True


def register() -> None:
    if envs.CALIB_CPU_SAMPLING_FIX:
        apply_cpu_sampling_fix()
    out_dir = envs.CALIB_COLLECT_DIR
    if out_dir:
        from calib.collect import hooks

        hooks.install(out_dir, envs.CALIB_NGRAM, routing=envs.CALIB_ROUTING,
                      shadow_router=envs.CALIB_SHADOW_ROUTER)
    tables = envs.CALIB_SERVE_TABLES
    if tables:  # serving mode (calib/serve/hooks.py); after capture, so both work when both are on
        from calib.serve import hooks as serve_hooks

        serve_hooks.install(tables, envs.CALIB_SERVE_COST, envs.CALIB_SERVE_MODEL_ID, envs.CALIB_NGRAM,
                            chains=envs.CALIB_SERVE_CHAINS, plan=envs.CALIB_SERVE_PLAN,
                            draft_cost=envs.CALIB_SERVE_DRAFT_COST)
