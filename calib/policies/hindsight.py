"""Hindsight policies, picked among the step policies' totals: ``best_fixed`` (the ladder's reference)
and ``vllm_dsd`` (vLLM's Dynamic SD: one K per batch size)."""

from __future__ import annotations

from calib.policies.base import Arm, Policy, Serving, register_policy


def best_fixed(rows: dict, pooled: dict | None = None) -> dict:
    """The best fixed γ in hindsight, γ = 0 (no_spec) included: the best static policy."""
    fixed = {k: v for k, v in rows.items() if k.startswith("fixed_")}
    if "no_spec" in rows:
        fixed["no_spec"] = {**rows["no_spec"], "gamma": 0}
    name = max(fixed, key=lambda k: (fixed[k]["tokens"] / fixed[k]["cost"], -fixed[k]["gamma"]))
    return dict(fixed[name])


def vllm_dsd(rows: dict, pooled: dict) -> dict:
    """vLLM's Dynamic SD (vLLM 0.32, ``vllm/v1/spec_decode/dynamic/utils.py``: the
    ``num_speculative_tokens_per_batch_size`` schedule, ``[(range_start, range_end, K), ...]`` expanded by
    ``build_dynamic_sd_schedule_lookup`` into a dense batch size -> K table the scheduler looks up each
    step; every request of the batch drafts and verifies K, K = 0 included). Here: the best such table
    in hindsight, one K per (bank, B, cost curve), chosen on the steps of every category pooled (a
    deployment keys the table on batch size only; it does not know the category), then served to every
    category at that B.

    Versus ``best_fixed``: that one picks γ per (bank, category, B, curve), i.e. per ladder slice. Read
    literally per slice ("per setting, the K maximising goodput over that setting's rounds"), vLLM's
    table would coincide with ``best_fixed`` exactly, because the ladder is already per B. So the
    difference is only the category: on a category row ``vllm_dsd`` serves the pooled K (≤ best_fixed
    there, equal where both categories prefer the same K); on the ``all`` row it *is* ``best_fixed``
    (same K, same steps, same goodput). Drafting is charged K passes, as ``fixed_K``.
    """
    table_k = best_fixed(pooled)["gamma"]
    chosen = rows["no_spec"] if table_k == 0 else rows[f"fixed_{table_k}"]
    return {**chosen, "gamma": table_k}


REFERENCE = register_policy(Policy(
    "best_fixed", 20, "0.35", "the fixed γ (0 = no_spec included) with the best goodput in hindsight per (bank, "
    "category, B, cost curve): the best static policy, and every row's reference", best_fixed,
    kind="hindsight", needs=("no_spec", "fixed"), camp="reference")).name
# Served: vLLM's Dynamic SD (speculative_config.num_speculative_tokens_per_batch_size), a schedule in its
# spirit (K halves as the batch grows past 4 and 16), not tuned on any prompt set; entries are
# [first batch size, last batch size, K], K <= the configured K.
register_policy(Policy(
    "vllm_dsd", 25, "tab:green", "vLLM Dynamic SD (num_speculative_tokens_per_batch_size): one K per batch size, "
    "the best in hindsight over both categories pooled (a deployment does not know the category) — on "
    "category `all` it is best_fixed; on a category row it is at most best_fixed, which picks γ per category",
    vllm_dsd, kind="hindsight", needs=("no_spec", "fixed"), camp="peer",
    below_no_spec="one K per batch size for every category: a K that pays on the pooled stream can lose on "
                  "the category with the lower acceptance",
    serving=Serving(speculate=True, dynamic=((1, 4, 4), (5, 16, 2), (17, 1024, 1)),
                    arms=(Arm("vllm_dynamic", "eagle"),)),
    aliases=("vllm_dynamic",)))
