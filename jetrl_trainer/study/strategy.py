"""Strategy names: ``train_precision/rollout_precision[+corrector][@exact|@plain]``, e.g. ``bf16/fp8+ais``.

The name is the unit the study runs, plots and tabulates. ``+none`` is dropped (``bf16/fp8+none``
reads as ``bf16/fp8``), so each strategy has one spelling. ``@exact`` and ``@plain`` pin the exact
on-policy log-probs (`JetGRPOConfig.exact_logprobs`) on or off for a unified strategy
(``fp8/fp8@exact``, ``fp8/fp8@plain``); without either the trainer's auto applies (on where the
engine decodes on CPU, off on CUDA), so the GPU study names them. The default sets live in
`jetrl_trainer._choices` (``STUDY_STRATEGIES``, ``STUDY_STRATEGIES_NVFP4``, ``GPU_STUDY_STRATEGIES``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from jetrl_trainer._choices import PRECISIONS, check_choice

__all__ = ["Strategy", "parse_strategies", "parse_strategy"]


@dataclass(frozen=True)
class Strategy:
    """One cell of the study: the two precisions and the corrector that a `JetGRPOConfig` gets."""

    train_precision: str
    rollout_precision: str
    corrector: str = "none"
    exact: str = "auto"  # "auto" | "exact" | "plain": `JetGRPOConfig.exact_logprobs` None | True | False

    @property
    def name(self) -> str:
        base = f"{self.train_precision}/{self.rollout_precision}"
        base = base if self.corrector == "none" else f"{base}+{self.corrector}"
        return base if self.exact == "auto" else f"{base}@{self.exact}"

    @property
    def slug(self) -> str:
        """The name as a folder name: ``bf16/fp8+ais`` -> ``bf16-fp8-ais``, ``fp8/fp8@exact`` -> ``fp8-fp8-exact``."""
        return self.name.replace("/", "-").replace("+", "-").replace("@", "-")

    def config_kwargs(self) -> dict:
        """The `JetGRPOConfig` fields this strategy sets."""
        fields = dict(train_precision=self.train_precision, rollout_precision=self.rollout_precision,
                      corrector=self.corrector)  # fmt: skip
        if self.exact != "auto":
            fields["exact_logprobs"] = self.exact == "exact"
        return fields

    def __str__(self) -> str:
        return self.name


def parse_strategy(name: str | Strategy) -> Strategy:
    """``"bf16/fp8+tis"`` -> ``Strategy("bf16", "fp8", "tis")``, ``"fp8/fp8@exact"`` -> ``Strategy("fp8",
    "fp8", exact="exact")``; case and spaces are ignored.

    The precisions must be in ``PRECISIONS``; the corrector must be registered
    (`jetrl_trainer.correctors.available_correctors`, which includes your own); ``@exact`` / ``@plain``
    need the unified flow (equal precisions), the only one whose log-probs can be exact.
    """
    if isinstance(name, Strategy):
        return name
    if not isinstance(name, str):
        raise ValueError(f"a strategy is a string like 'bf16/fp8+ais'; got {name!r}")
    text = name.strip().lower().replace(" ", "")
    text, at, exact = text.partition("@")
    if at and exact not in ("exact", "plain"):
        raise ValueError(f"strategy {name!r}: after '@' write 'exact' or 'plain' (e.g. 'fp8/fp8@exact'), "
                         f"or drop the '@' part for the trainer's auto.")  # fmt: skip
    pair, plus, corrector = text.partition("+")
    train, slash, rollout = pair.partition("/")
    if not slash or not train or not rollout or (plus and not corrector):
        raise ValueError(
            f"strategy {name!r} must read 'train_precision/rollout_precision[+corrector]', e.g. 'bf16/fp8+ais' "
            "or 'fp8/fp8'."
        )
    train = check_choice(f"train precision of strategy {name!r}", train, PRECISIONS)
    rollout = check_choice(f"rollout precision of strategy {name!r}", rollout, PRECISIONS)
    if at and train != rollout:
        raise ValueError(f"strategy {name!r}: '@{exact}' applies to the unified flow only (equal precisions, e.g. "
                         f"'{rollout}/{rollout}@{exact}'); a '{train}/{rollout}' rollout is never exact, so drop "
                         f"'@{exact}'.")  # fmt: skip
    return Strategy(train, rollout, _check_corrector(name, corrector or "none"), exact or "auto")


def _check_corrector(name: str, corrector: str) -> str:
    from jetrl_trainer.correctors import available_correctors  # torch only; the registry may grow

    return check_choice(f"corrector of strategy {name!r}", corrector, available_correctors())


def parse_strategies(names: str | Iterable[str | Strategy]) -> tuple[Strategy, ...]:
    """A comma-separated string or a sequence of names; duplicates (after normalising) are refused."""
    items = [n for n in names.split(",") if n.strip()] if isinstance(names, str) else list(names)
    if not items:
        raise ValueError("no strategies given; name at least one, e.g. 'bf16/bf16,bf16/fp8'.")
    strategies = tuple(parse_strategy(n) for n in items)
    seen: set[Strategy] = set()
    for s in strategies:
        if s in seen:
            raise ValueError(f"strategy {s.name!r} is listed twice; list each strategy once.")
        seen.add(s)
    return strategies
