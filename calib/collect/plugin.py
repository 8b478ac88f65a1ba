# TEMPORARY until the venv is reinstalled (integrator removes): the installed entry point still names
# calib.collect.plugin:register; pyproject.toml now names calib.vllm.plugin:register.
from calib.vllm.plugin import register  # noqa: F401
