# tandem — the two commands: `make demo` (main job on the CPU default) and `make test`.
# Everything else is a building block of those two.
PYTHON ?= python3
CONFIG ?= configs/demo_cpu.yaml
GPUS ?= 0
RUN ?= runs/demo
STAMP := .make/installed

.PHONY: install test test-gpu demo data tiny-model tiny-detector launch-rollout stage-b bench docs plot clean

$(STAMP): pyproject.toml
	@mkdir -p .make
	@# torch first: 2.13.0 is the local CPU wheel; a bare range would pull GBs of CUDA packages.
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install -q torch==2.13.0
	$(PYTHON) -m pip install -q -e '.[dev]'
	@touch $(STAMP)

install: $(STAMP)

data: $(STAMP)
	$(PYTHON) -m common.data.synthetic --out artifacts/data/synth --n 96 --seed 0
	$(PYTHON) -m common.data.synthetic --out artifacts/data/detect --split 4096/64 --seed 0 --sides 112 --max-objects 3 --size-range 0.25/0.6

tiny-model: $(STAMP)
	$(PYTHON) tools/make_tiny_model.py --out artifacts/tiny-model

# Stage-1 warm start of the tiny model on the detection set (a few minutes on 2 cores, once: cached).
tiny-detector: $(STAMP) data tiny-model
	$(PYTHON) -m learner.warm_start --config configs/warm_start_cpu.yaml --out artifacts/tiny-detector

# Two workers (pytest-xdist), one test file each at a time: module fixtures (a server per file) stay shared, and
# most multi-process tests wait on peers half the time, so 2 cores run the suite in ~60 % of the serial time.
# The file order is tests/conftest.py's (the detector build first, then the files with most tests), not xdist's.
test: $(STAMP)
	$(PYTHON) -m pytest -q -m "not gpu" -n 2 --dist loadfile --no-loadscope-reorder --durations=15

test-gpu: $(STAMP)
	$(PYTHON) -m pytest -q -m gpu -rs

# A second `make demo` moves the previous demo run aside (runs/demo.old-<its start time>), never deletes it.
demo: $(STAMP) data tiny-model tiny-detector
	$(PYTHON) -m launcher --config $(CONFIG) training.overwrite=true

launch-rollout: $(STAMP)
	$(PYTHON) -m rollout_server --config $(CONFIG)

stage-b: $(STAMP) tiny-model
	$(PYTHON) -m stage_b.launch --gpus $(GPUS) --config configs/stage_b/demo_cpu.yaml

# The CPU benchmarks of each component (bench/scenarios/cpu-components.yaml); every named scenario, GPU ones
# included, with what it needs: python3 bench/run_scenario.py --list (docs/benchmarks.md).
bench: $(STAMP) data tiny-model
	$(PYTHON) bench/run_scenario.py cpu-components --out runs/bench --echo

docs: $(STAMP)
	$(PYTHON) -m common.config.docs --markdown > docs/config.md

plot: $(STAMP)
	$(PYTHON) -m launcher.plot $(RUN)

clean:
	rm -rf .make runs artifacts
