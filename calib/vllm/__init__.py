"""calib's vLLM wing: the plugin (:mod:`~calib.vllm.plugin`), the engine builder (:mod:`~calib.vllm.engine`),
one patch set over vLLM's runner (:mod:`~calib.vllm.patches`) and its subscribers, capture
(:mod:`~calib.vllm.capture`) and serving (:mod:`~calib.vllm.serving`). See docs/vllm_wing.md.
"""
