"""Which module group a Qwen-VL parameter (or module) name belongs to: vision, merger, llm or rest.

One home for the name rules that ``model.freeze``, ``model.adapter`` and ``training.lr_groups`` act through
(common/config/recipe.py names the groups): the learner applies them to the live model (learner/recipe.py),
the launcher's memory estimate to the safetensors headers of ``model.path`` (launcher/gpu_budget.py)::

    model.visual.merger.* / model.visual.deepstack_merger_list.*   -> merger
    model.visual.*                                                 -> vision
    model.language_model.* / lm_head.*                             -> llm
    anything else                                                  -> rest (trains at training.lr)

A checkpoint stored under the older names (``visual.*``, ``model.layers.*``) maps the same for the vision
groups; its text weights fall to ``rest`` here (the live model renames them to ``model.language_model.*``).

What this module does not know: torch, peft or the config.
"""

from __future__ import annotations

import re

#: Order of the optimizer's parameter groups (``rest`` = parameters outside the three named groups).
GROUP_ORDER = ("vision", "merger", "llm", "rest")
_MERGER = re.compile(r"(^|\.)visual\.(merger|deepstack_merger_list)\.")
_VISION = re.compile(r"(^|\.)visual\.")
_LLM = re.compile(r"(^|\.)(language_model\.|lm_head\.)")
#: peft module names a module group's layers match (``exclude_modules`` keeps a frozen group's layers plain).
GROUP_MODULE_REGEX = {
    "merger": r".*visual\.(merger|deepstack_merger_list)\..*",
    "vision": r".*visual\.(?!merger\.|deepstack_merger_list\.).*",
    "llm": r".*(language_model\..*|lm_head)",
}


def group_of(name: str) -> str:
    """The module group of a parameter (or module) name: vision, merger, llm or rest."""
    if _MERGER.search(name):
        return "merger"
    if _VISION.search(name):
        return "vision"
    if _LLM.search(name) or name.startswith("lm_head"):
        return "llm"
    return "rest"
