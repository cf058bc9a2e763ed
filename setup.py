"""gagar_jax: groupwise agentic grading and sum-preserving advantage redistribution in JAX."""

import setuptools

# Core: the JAX stack. Versions are pinned in constraints.txt (verified together on
# CPU); the ranges here only state what the code is written against.
INSTALL_REQUIRES = [
    "jax>=0.10",
    "flax>=0.12.8",
    "optax>=0.2.8",
    "orbax-checkpoint>=0.12.8",
    "chex>=0.1.92",
    "absl-py>=2.0",
    "ml-collections>=1.1",
    "numpy>=2.0",
    # gagar_jax.rollout: the SGLang client (the server itself lives in .venv-sglang).
    "httpx>=0.27",
    "safetensors>=0.6",
    # gagar_jax.envs.hf_tokenizer: Hugging Face tokenizers + chat templates without transformers.
    "tokenizers>=0.20",
    "jinja2>=3.1",
    # Training metrics: TensorBoard event files and the per-run plots.
    "tensorboardX>=2.6",
    "matplotlib>=3.8",
    # gagar_jax.verify.confusables: Unicode's confusables data (UTS #39) for the monitor's text
    # rules and the grader views.
    "confusable-homoglyphs==3.3.1",
]

EXTRAS_REQUIRE = {
    # Everything the test suite needs besides the core (the official OpenAI and Anthropic SDKs
    # are the gateway tests' clients).
    "test": [
        "pytest>=8",
        "pytest-xdist>=3",
        "hypothesis>=6.100",
        "ruff>=0.6",
        "jsonschema>=4",
        "openai==3.51.0",
        "anthropic==2.10.0",
    ],
    # gagar_jax.rollout.gateway: the OpenAI/Anthropic-compatible gateway any agent harness
    # talks to (FastAPI on uvicorn).
    "gateway": ["fastapi==0.163.2", "uvicorn==0.54.0"],
    # The reference agent harness, run through the gateway. It goes in a venv of its own
    # (scripts/setup_agents.sh builds .venv-agents): its litellm pins stay out of the JAX stack.
    "agents": ["mini-swe-agent==2.4.6"],
    # TFDS builders for task pools (no TensorFlow needed for array_record).
    # (tfds 4.9.10 imports importlib_resources for builders outside its package.)
    "data": ["tensorflow-datasets>=4.9.10", "importlib_resources>=6"],
    # Parity tests against Hugging Face transformers and peft (the LoRA export; CPU torch; pinned
    # in constraints.txt:
    # an unpinned torch pulls a multi-GB CUDA build).
    "parity": ["torch==2.13.0", "transformers==5.24.0", "peft==0.22.0"],
    # The browser judge (gagar_jax.verify.browser): the Playwright driver for Debian's chromium
    # (`make system-deps` installs it; `playwright install` is not used).
    "browser": ["playwright==1.65.2"],
    # Real software-engineering tasks (gagar_jax.data.swe/repos/synth): uv builds the tasks'
    # environments, libcst makes the factory's bugs, pytest-timeout bounds each test, pyarrow
    # reads parquet rows. (swebench, whose pytest log parser is the reference in the tests, is
    # installed by `make setup` without its dependencies: they include docker and modal.)
    "swe": ["uv==0.13.9", "libcst==1.9.0", "pytest-timeout==2.4.0", "pyarrow>=15"],
    # The Ray execution back-end (gagar_jax.verify.execution): verification, tools and grading on
    # a cluster, and the fault-injection tests on a simulated one (pytest -m ray).
    "ray": ["ray==2.60.0"],
    # Executed notebooks.
    "notebooks": ["ipykernel", "nbclient", "nbformat", "matplotlib"],
    # The documentation site (`make docs`): Sphinx, MyST markdown and notebooks, the furo theme.
    "docs": ["sphinx==9.0.4", "myst-parser==5.2.0", "myst-nb==1.4.0", "furo==2025.12.19"],
}

setuptools.setup(
    name="gagar_jax",
    version="0.1.0",
    description=__doc__,
    # configs/: the experiment configs, importable (`from configs import toy_gagar`).
    packages=setuptools.find_packages(include=["gagar_jax", "gagar_jax.*", "configs"]),
    # Versioned grader prompts (gagar_jax/grading/prompts/<version>/*.md).
    package_data={
        "gagar_jax.grading": ["prompts/*/*.md", "sets/*/*/*.jsonl"],
        "gagar_jax.verify": ["prompts/*/*.md"],
        "gagar_jax.data": ["prompts/*/*.md"],
        "gagar_jax.envs": ["prompts/*/*.md"],
    },
    python_requires=">=3.11",
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS_REQUIRE,
)
