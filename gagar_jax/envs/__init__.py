"""Task families: the toy executable code-repair family (CPU runs) and Python-repository tasks."""

from gagar_jax.envs.tokenizer import TOKENIZER, ToyTokenizer
from gagar_jax.envs.toy import (
    DIFFICULTIES,
    QUALITY_DIMENSIONS,
    PatchError,
    ToyTask,
    ToyTaskGenerator,
    Verification,
    apply_patch,
    candidate_patches,
    parse_patch,
    verify,
)

__all__ = [
    "DIFFICULTIES",
    "QUALITY_DIMENSIONS",
    "TOKENIZER",
    "PatchError",
    "ToyTask",
    "ToyTaskGenerator",
    "ToyTokenizer",
    "Verification",
    "apply_patch",
    "candidate_patches",
    "parse_patch",
    "verify",
]
