# Every target bootstraps what it needs: `make test` and `make train` work on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
EXTRAS ?= test,data,parity,notebooks,browser,docs,swe,ray,gateway
export XLA_FLAGS ?= --xla_force_host_platform_device_count=8
# Local Ray clusters (tests, make e2e) bind to 127.0.0.1, not to the machine's network interface.
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER ?= 0

SGLANG_VENV ?= .venv-sglang
# The unit pass (`make test-unit`, and `make test`'s first pass): every test but the end-to-end
# runs and those that need a real SGLang server, a Ray cluster, a browser or containers. One worker per core
# (a third worker measured no faster on 2 cores); work stealing: a worker that runs out of tests
# takes the other's queued ones.
UNIT_ARGS ?= -n 2 --dist worksteal -m "not e2e and not sglang and not ray and not browser and not bench and not container"

.PHONY: setup system-deps sglang-venv agents-venv test test-e2e test-unit test-private-clone bench-check lint format-check docs train compare feedback-compare grader-student example bench tasks e2e clean

$(VENV)/.installed: setup.py constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[$(EXTRAS)]'
	$(PY) -m pip install -q --no-deps -c constraints.txt swebench==5.0.2
	touch $@

setup: $(VENV)/.installed

# System packages (Debian/Ubuntu, root or sudo) for the sandboxed verifier: bubblewrap, and a
# python3 an unprivileged uid can run (the sandbox cannot use a pyenv interpreter under /root);
# Debian's chromium for the browser judge (driven by the playwright wheel, never downloaded);
# podman, runc and mmdebstrap for the container back-end (its base image is built from Debian
# packages: no image registry needed).
system-deps:
	@PKGS=""; command -v bwrap >/dev/null || PKGS="bubblewrap"; \
	  [ -x /usr/bin/python3 ] || PKGS="$$PKGS python3"; \
	  [ -x /usr/bin/chromium ] || PKGS="$$PKGS chromium"; \
	  command -v podman >/dev/null || command -v docker >/dev/null || PKGS="$$PKGS podman"; \
	  command -v runc >/dev/null || PKGS="$$PKGS runc"; \
	  command -v mmdebstrap >/dev/null || PKGS="$$PKGS mmdebstrap"; \
	  [ -z "$$PKGS" ] || { SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -q && $$SUDO apt-get install -y -q $$PKGS; }

# A real SGLang server for the rollout/grader tests, in its own venv (it pins torch and numpy).
$(SGLANG_VENV)/.installed: scripts/setup_sglang.sh scripts/sglang-requirements.txt
	PYTHON=$(PYTHON) bash scripts/setup_sglang.sh $(SGLANG_VENV)

sglang-venv: $(SGLANG_VENV)/.installed

# The reference agent harness (mini-swe-agent, the `agents` extra) in its own venv, run inside the
# sandbox through the gateway (gagar_jax.envs.harness); built on /usr/bin/python3, which the
# sandbox's unprivileged uid can run.
AGENTS_VENV ?= .venv-agents
$(AGENTS_VENV)/.installed: scripts/setup_agents.sh
	bash scripts/setup_agents.sh $(AGENTS_VENV)

agents-venv: $(AGENTS_VENV)/.installed

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# The formatter's verdict on the whole tree (ruff format; `# fmt: skip` only where a table reads
# better aligned, with the reason beside it).
format-check: setup
	$(VENV)/bin/ruff format --check .

# `make test`: every test but the end-to-end runs. Tests marked `browser` drive a real headless
# Chromium (one per test module: a worker takes whole files); tests marked `sglang` share one
# real SGLang server per pytest process, so they run in a single-process pass of their own
# (xdist's loadgroup does not group under pytest 9); tests marked `ray` start a simulated
# multi-node Ray cluster each; tests marked `container` verify in podman/docker containers of a
# base image built once from Debian packages into $(CONTAINER_CACHE) and reused.
CONTAINER_CACHE ?= $(HOME)/.cache/gagar_jax/containers
test: setup system-deps sglang-venv lint
	$(PY) -m pytest -q $(UNIT_ARGS) tests
	$(PY) -m pytest -q -n 2 --dist loadfile -m "browser and not e2e and not sglang" tests
	$(PY) -m pytest -q -m "sglang and not e2e" tests
	$(PY) -m pytest -q -m "ray and not e2e" tests
	GAGAR_CONTAINER_CACHE=$(CONTAINER_CACHE) \
	  $(PY) -m pytest -q -n 2 --dist worksteal -m "container and not e2e" tests

# The end-to-end runs (scripts, several processes, SIGKILL and resume, the task factory): minutes
# each, so CI runs them as a step of their own after `make test`.
# The task factory's run times its sandboxed validations, so it runs alone, after the others.
test-e2e: setup system-deps sglang-venv agents-venv
	$(PY) -m pytest -q -n 2 -m "e2e and not sglang and not bench" --ignore=tests/test_data_synth.py tests
	$(PY) -m pytest -q -m e2e tests/test_data_synth.py
	$(PY) -m pytest -q -m "e2e and sglang" tests

# `make test` from a checkout in a private (0700) directory, as a user's home is: the committed
# tree (HEAD, not uncommitted edits) cloned into PRIVATE_DIR/repo (PRIVATE_DIR made 0700; default
# a new temporary directory, removed after; an existing PRIVATE_DIR/repo is an error), where
# `make test` bootstraps its own venvs and runs every pass. The sandbox's unprivileged uids,
# the containers, Ray's workers, the browser and the SGLang server must all work from there.
# CI runs `make test` this way.
PRIVATE_DIR ?=
test-private-clone: system-deps
	@PRIV="$(PRIVATE_DIR)"; if [ -z "$$PRIV" ]; then PRIV=$$(mktemp -d); trap 'rm -rf "$$PRIV"' EXIT; \
	  else mkdir -p "$$PRIV"; fi; chmod 700 "$$PRIV" && \
	  { [ ! -e "$$PRIV/repo" ] || { echo "test-private-clone: $$PRIV/repo exists" >&2; exit 2; }; } && \
	  git clone -q . "$$PRIV/repo" && echo "test-private-clone: make test in $$PRIV/repo (0700)" && \
	  $(MAKE) -C "$$PRIV/repo" test

# The quick check before a commit: every unit test, i.e. `make test`'s first pass (no end-to-end
# runs, no SGLang server, no Ray cluster, no browser, no second venv needed).
test-unit: setup
	$(PY) -m pytest -q $(UNIT_ARGS) tests

# The race's equal-work check on all three frameworks (builds the TRL and Tunix venvs: minutes).
bench-check: setup
	$(PY) -m pytest -q -m bench tests/test_bench_rl_step.py

# The documentation site: warnings are errors, and so is a public symbol (a name in a package's
# __all__) without an API entry or a docstring (docs/_ext/coverage_check.py).
docs: setup
	$(VENV)/bin/sphinx-build -W --keep-going -j auto -b html docs docs/_build/html

# The main job: toy_gagar on CPU (~10 min on 2 cores); ends with a summary and
# runs/toy_gagar/training_dynamics.png. Re-running resumes (a finished run just re-summarises);
# `make train RUN=runs/other` for a fresh directory.
RUN ?= runs/toy_gagar
# One CPU device (XLA_FLAGS cleared): 8 simulated devices only add collectives on 2 cores.
train: setup
	XLA_FLAGS= $(PY) scripts/train.py --config=configs/toy_gagar.py --workdir=$(RUN)

# The toy ablation (paper Figs. 2-4): every mode x SEEDS seeds, run after run, then
# runs/compare/ablation.{md,png,json} (mean and standard error over seeds, +-1 SE bands).
# `make compare SEEDS=5 COMPARE_ARGS="--config.sft.steps=150 --config.loop.total_steps=30"`
# is the sweep in the README; each run there takes ~5 min on the shared 2-core machine.
COMPARE ?= runs/compare
SEEDS ?= 1
COMPARE_MODES ?= gagar binary discount_only gagar_token
COMPARE_ARGS ?=
# a configs/toy_gagar.py variant word added to each mode (e.g. imbalanced: the discount-only regime)
COMPARE_VARIANT ?=
# a number of held-out tasks: then scripts/heldout_gain.py evaluates every run's SFT start and end
# on that many tasks x 4 samples with the same draws, paired by seed, into
# $(COMPARE)/heldout_gain.{md,png,json} (the runs keep step 0: COMPARE_VARIANT=weak_start does).
# `make compare SEEDS=5 COMPARE_MODES="gagar binary" COMPARE_VARIANT=weak_start COMPARE_HELDOUT=512`
# is docs/results/heldout_gain.md (~5 min a run on the shared 2-core machine).
COMPARE_HELDOUT ?=
comma := ,
empty :=
space := $(empty) $(empty)
compare: setup
	for s in $$(seq 0 $$(( $(SEEDS) - 1 ))); do for m in $(COMPARE_MODES); do \
	  XLA_FLAGS= $(PY) scripts/train.py \
	    --config=configs/toy_gagar.py:$$m$(if $(COMPARE_VARIANT),$(comma)$(COMPARE_VARIANT)) \
	    --workdir=$(COMPARE)/$$m/seed$$s --config.seed=$$s $(COMPARE_ARGS) || exit 1; \
	done; done
	$(PY) scripts/compare_runs.py --root=$(COMPARE) --seeds=$(SEEDS) --out=$(COMPARE) \
	  --modes=$(subst $(space),$(comma),$(strip $(COMPARE_MODES))) \
	  --command='make compare SEEDS=$(SEEDS) COMPARE_ARGS="$(COMPARE_ARGS)"$(if $(COMPARE_VARIANT), COMPARE_VARIANT=$(COMPARE_VARIANT))$(if $(filter-out gagar binary discount_only gagar_token,$(COMPARE_MODES))$(filter-out 4,$(words $(COMPARE_MODES))), COMPARE_MODES="$(COMPARE_MODES)")'
	$(if $(COMPARE_HELDOUT),$(PY) scripts/heldout_gain.py --root=$(COMPARE) --seeds=$(SEEDS) \
	  --modes=$(subst $(space),$(comma),$(strip $(COMPARE_MODES))) --num_tasks=$(COMPARE_HELDOUT) \
	  --command='make compare SEEDS=$(SEEDS) COMPARE_MODES="$(COMPARE_MODES)" COMPARE_ARGS="$(COMPARE_ARGS)" COMPARE_VARIANT=$(COMPARE_VARIANT) COMPARE_HELDOUT=$(COMPARE_HELDOUT)')

# End to end with a real SGLang server in the loop (scripts/e2e.py): tiny random Qwen2 + local
# BPE tokenizer, the fixture repositories, SFT warm start on tool-call demonstrations, 3 RL steps
# of configs/swe_agent.py:smoke, SIGKILL after a checkpoint and resume; into runs/e2e/.
# A default pool of real-package tasks for configs/swe_agent.py (gagar_jax.data.synth: sdists
# from the registry, uv environments, procedural bugs validated in the sandbox) in data/tasks/.
TASK_PACKAGES ?= toolz==1.0.0,cachetools==8.0.2,six==1.17.0,inflection==0.5.1,wcwidth==0.2.13,semver==3.1.2,boltons==26.2.0,idna==3.20,pathspec==1.1.1,more-itertools==11.2.1
TASKS_PER_PACKAGE ?= 25
tasks: setup system-deps
	$(PY) -m gagar_jax.data.synth --packages $(TASK_PACKAGES) \
		--tasks-per-package $(TASKS_PER_PACKAGE) --out data/tasks

# `make e2e E2E_ARGS=--execution=ray`: the same run with verification on a simulated Ray cluster.
# Then scripts/e2e_harness.py: 3 RL steps whose every episode is an unmodified mini-swe-agent run
# through the gateway on the factory's real-package task (embedded sampler; the update's
# log-probs equal the recorded ones; the run's episodes exported as ATIF and read back).
# Then the same on the CPU SGLang server (its k3 printed; about 9 minutes on a loaded 2-core
# machine); `make e2e E2E_HARNESS_SGLANG=` leaves it out.
E2E_ARGS ?=
E2E_HARNESS_SGLANG ?= 1
e2e: setup system-deps sglang-venv agents-venv
	$(PY) scripts/e2e.py --out=runs/e2e $(E2E_ARGS)
	$(PY) scripts/e2e_harness.py --out=runs/e2e_harness --model-dir=runs/e2e/model
	$(if $(E2E_HARNESS_SGLANG),$(PY) scripts/e2e_harness.py --out=runs/e2e_harness --model-dir=runs/e2e/model --engine=sglang)

# The feedback study: sft, rw_sft, span_kto, sft_drop_negative, sft_penalize_negative x 3 seeds on
# one shared simulated-user feedback dataset -> runs/feedback_compare/comparison.{md,png}.
FEEDBACK_OUT ?= runs/feedback_compare
feedback-compare: setup
	XLA_FLAGS= $(PY) scripts/feedback_compare.py --out=$(FEEDBACK_OUT) --seeds=0,1,2

# The agentic grader on a protocol student (docs/grader_quality.md): trains the 0.84M student on
# the heuristic grader's answers to the compact prompts, serves it on the CPU SGLang server and
# grades the toy held-out half and the repo set with three constrained greedy votes (ranks taken
# tiers first, uncited low scores dropped) and the permutation probe; rows in
# $(STUDENT)/summary.json. About an hour on 2 shared cores.
STUDENT ?= runs/agentic_student
grader-student: setup sglang-venv
	XLA_FLAGS= $(PY) scripts/train_agentic_student.py --out=$(STUDENT) --steps 300 \
	  --export-every 150 --eval toy:heldout,repo --votes 3 --workers 14 --probes permute \
	  --rank-order tier_first --uncited-scores drop_uncited

example: setup
	$(PY) scripts/gagar_example.py

bench: setup
	XLA_FLAGS= $(PY) benchmarks/advantages.py
	$(PY) benchmarks/grading.py --quick
	$(PY) benchmarks/verify.py
	XLA_FLAGS= $(PY) benchmarks/sampler.py --data-parallel 2
	$(PY) benchmarks/browser_judge.py --rounds 1
	XLA_FLAGS= $(PY) benchmarks/gemm_shapes.py --configs small

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
